"""What code generation produces for the runtime and for `fuselm inspect`."""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from ..compiler.kernels import ScheduledKernel
from .tuning import Target, Tuning


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel family is handed to generate one scheduled kernel."""
    G: nx.DiGraph             # the compiled graph
    launch: ScheduledKernel   # the kernel of its schedule
    ctx: int                  # KV cache rows (the context length) the attention kernels are built for
    tokens: int               # tokens per step: 1 (decode) or a prefill step's
    target: Target
    tuning: Tuning


@dataclass
class Launch:
    """One kernel launch of the schedule."""
    function: str             # extern "C" entry point in the compiled module
    grid: tuple[int, int]     # ("T" in the schedule becomes the token count at run time)
    block: int
    args: list[str]           # graph value names, or runtime buffers such as "workspace"
    smem: int = 0             # bytes of dynamic shared memory


@dataclass
class Variant:
    """Launches that replace a kernel's general `launches` at positions from the previous variant's
    `until` (or 0) below this one's (attention: one launch at short contexts)."""
    name: str                 # "single": how tests and CudaEngine(variant=...) call it
    until: int
    launches: list[Launch]
    note: str                 # what it does instead, for `fuselm inspect`


@dataclass
class KernelSource:
    """One generated kernel: its CUDA source, the graph nodes it covers and how it is launched."""
    name: str                 # derived from the family, its shape constants and a hash of its body
    family: str
    source: str               # CUDA C++, identical for every layer that has the same structure
    nodes: list[str]          # graph nodes it implements (differs per layer)
    launches: list[Launch]
    layer: int | None
    bytes_read: int = 0       # per token, weights + activations (+ KV cache at the planned context)
    bytes_written: int = 0
    workspace_floats: int = 0
    slab_floats: int = 0      # split-K gemm (prefill): its "gemm_slabs" floats and "gemm_counts" words
    tile_counts: int = 0
    staged_floats: int = 0    # gemm with its vectors staged (prefill): its "gemm_x" floats
    # attention: which pass runs where ("split", "one launch", "wide split") -> attention.Pass
    passes: dict = field(default_factory=dict)
    # By increasing `until`; the runtime keeps one CUDA graph per range of positions.
    variants: list[Variant] = field(default_factory=list)
    source_order: list[str] = field(default_factory=list)   # functions(), where launches list them otherwise

    def launches_at(self, position: int) -> list[Launch]:
        """The launches that serve a step at `position`: the first variant whose range holds it."""
        return next((v.launches for v in self.variants if position < v.until), self.launches)

    def launches_of(self, variant: str) -> list[Launch]:
        """The launches of the variant named `variant` (the general ones where it has no such)."""
        return next((v.launches for v in self.variants if v.name == variant), self.launches)

    def all_launches(self) -> list[Launch]:
        """Every launch this kernel's module must provide, variants included."""
        return self.launches + [l for v in self.variants for l in v.launches]

    def functions(self) -> list[str]:
        """Its extern "C" functions in the order its source defines them."""
        return self.source_order or list(dict.fromkeys(l.function for l in self.all_launches()))

    def annotated(self) -> str:
        """The source headed by a comment listing the graph nodes it implements (for inspect)."""
        head = f"// {self.name} ({self.family}), layer {self.layer}\n// implements: {', '.join(self.nodes)}\n"
        return head + self.source
