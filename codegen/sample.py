"""The sample family: the kernel that ends every decode step, picking the next token on the GPU
(templates/sample.cu.j2) and advancing the position, so a step needs nothing from the host."""
from __future__ import annotations

from .kernel import KernelSource, Launch
from .render import render
from .tuning import Tuning

ARGS = ["logits", "seen", "sampling_args", "sampled", "pos", "sampler_scratch"]   # runtime buffers


def generate(vocab: int, tuning: Tuning) -> KernelSource:
    """The sampler over `vocab` logits. Its launch reads a runtime buffer "sampler_scratch" of
    scratch_words(tuning) zeroed uint32."""
    blocks = tuning.sampler_blocks
    name, source = render("sample.cu.j2", "sample", f"v{vocab}", hashed=False, V=vocab, blocks=blocks)
    return KernelSource(name, "sample", source, ["logits"], [Launch(name, (blocks, 1), 1024, ARGS)], None,
                        vocab * 4, 8)


def scratch_words(tuning: Tuning) -> int:
    """uint32 words of the sampler's scratch: a value and an index per block, and a counter."""
    return 2 * tuning.sampler_blocks + 1


def generate_row_picks() -> tuple[str, str]:
    """(name, source) of the kernel that draws a batch step's sampled rows on the GPU, each row's
    filters as runtime/sampling.sample_rows computes them (templates/row_picks.cuh: radix
    selects instead of a sort); launched by sample_rows on CuPy rows, PICK_THREADS a block."""
    return render("row_picks.cu.j2", "row_picks", "f64", hashed=False)


PICK_THREADS = 1024   # templates/row_picks.cuh
