"""Kernel launches that may overlap their predecessor: programmatic dependent launch (PDL).

CuPy launches through cuLaunchKernel, where a kernel starts only once the previous one on the
stream has finished: the GPU drains, then ramps up again, at every one of the ~100-200 kernel
boundaries of a decode step. cuLaunchKernelEx with the programmatic-stream-serialization
attribute lets the next kernel's blocks be scheduled early; a generated GEMV issues its first
weight loads and only then waits (`grid_wait_then_release` in common.cuh) until the previous
grid's writes are visible, so the weight stream does not stop at the kernel boundary. Stream capture records such launches as programmatic edges of the CUDA graph.

The driver entry point is called through ctypes (CuPy does not wrap it), from Hopper (sm_90) on.
"""
from __future__ import annotations

import ctypes

from ..errors import FuselmError

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def pdl_wanted(capability: int) -> bool:
    """Whether to launch with PDL on a device of this compute capability (90 for sm_90): from
    Hopper on, where the driver library has cuLaunchKernelEx."""
    if capability < 90:
        return False
    try:
        return hasattr(ctypes.CDLL("libcuda.so.1"), "cuLaunchKernelEx")
    except OSError:
        return False


class PdlLaunch:
    """One kernel launch, its arguments (device pointers) resolved once, replayable on a stream."""

    _driver = None

    def __init__(self, function, grid: tuple[int, int], block: int, args: tuple, smem: int = 0):
        if PdlLaunch._driver is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            PdlLaunch._driver = lib
        self.function = ctypes.c_void_p(getattr(function, "kernel", function).ptr)   # RawKernel or Function
        self.attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1                       # programmaticStreamSerializationAllowed (an int at offset 0)
        self.config = LaunchConfig(grid[0], grid[1], 1, block, 1, 1, smem, None, ctypes.pointer(self.attr), 1)
        self.buffers = args                                           # kept alive with the launch
        self.values = [ctypes.c_void_p(a.data.ptr) for a in args]     # every argument is a buffer
        self.params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(v) for v in self.values])

    def __call__(self, stream) -> None:
        self.config.hStream = stream.ptr
        err = self._driver.cuLaunchKernelEx(ctypes.byref(self.config), self.function, self.params, None)
        if err:
            name = ctypes.c_char_p()
            self._driver.cuGetErrorName(err, ctypes.byref(name))
            raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({err})")


def bind_launch(module, launch, buffer_of, pdl: bool, tokens: int = 1):
    """`launch` (codegen's Launch) of `module` with its arguments resolved once by `buffer_of`
    (graph value -> device array) and "T" in its grid read as `tokens`: a call taking the stream,
    launched with PDL when `pdl`. A launch with more dynamic shared memory than the default 48 kB
    opts its function into that much first."""
    fn = module.get_function(launch.function)
    grid = tuple(tokens if g == "T" else g for g in launch.grid)
    args = tuple(buffer_of(a) for a in launch.args)
    if launch.smem > 48 * 1024:
        try:
            fn.max_dynamic_shared_size_bytes = launch.smem
        except Exception as e:  # CUDA_ERROR_INVALID_VALUE: more than the device lets one block hold
            import cupy
            optin = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
            raise FuselmError(f"kernel {launch.function} asks for {launch.smem} B of dynamic shared memory "
                              f"beside {fn.shared_size_bytes} B static; the device allows "
                              f"{optin} B per block ({e})") from None
    if pdl:
        return PdlLaunch(fn, grid, launch.block, args, launch.smem)
    return lambda stream: fn(grid, (launch.block,), args, stream=stream, shared_mem=launch.smem)


def arena_view(cupy, arena, G, store: str):
    """The slice of `arena` (uint8) that the buffer plan of compiled graph `G` gives value `store`,
    typed as the value is (int32 or float32)."""
    offset, nbytes = G.graph["buffers"][store]
    return arena[offset:offset + nbytes].view(cupy.int32 if G.nodes[store]["dtype"] == "i32" else cupy.float32)


def load_cubin(cupy, cubin: bytes):
    """Load a cubin through a file in the kernel cache (RawModule loads from a path)."""
    import hashlib

    from ..codegen.nvrtc import cache_dir
    path = cache_dir() / f"{hashlib.sha256(cubin).hexdigest()}.module.cubin"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(cubin)
    return cupy.RawModule(path=str(path))

