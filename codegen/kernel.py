"""What code generation produces for the runtime and for `fuselm inspect`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Launch:
    """One kernel launch of the schedule."""
    function: str             # extern "C" entry point in the compiled module
    grid: tuple[int, int]     # ("T" in the schedule becomes the token count at run time)
    block: int
    args: list[str]           # graph value names, or runtime buffers such as "workspace"


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
    notes: dict = field(default_factory=dict)
    # While the position is below short_until, short_launches replace `launches` (an attention
    # kernel's one-launch variant for short contexts); the runtime keeps a CUDA graph for each.
    short_until: int = 0
    short_launches: list[Launch] = field(default_factory=list)

    def launches_at(self, position: int) -> list[Launch]:
        """The launches that serve a step at `position`."""
        return self.short_launches if position < self.short_until else self.launches

    def annotated(self) -> str:
        """The source headed by a comment listing the graph nodes it implements (for inspect)."""
        head = f"// {self.name} ({self.family}), layer {self.layer}\n// implements: {', '.join(self.nodes)}\n"
        return head + self.source
