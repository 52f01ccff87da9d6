"""The Python API: load a model once, then stream generations from it.

    import fuselm
    model = fuselm.load()                       # the embedded SmolLM2-135M-Instruct
    for piece in model.generate("The capital of France is", max_new_tokens=20):
        print(piece, end="", flush=True)
    print(model.last_stats.summary())
    for piece in model.chat([{"role": "user", "content": "Hi!"}]):
        ...
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Sequence

from .errors import FuselmError
from .dsl.kv_dtype import resolve_kv
from .runtime.engine import Engine, SamplingParams
from .runtime.generate import GenerationStats, encode_prompt, generate

DEFAULT_MAX_CONTEXT = 4096   # KV cache rows when ctx is not given (and the model allows as many)
DEVICES = ("auto", "cpu", "cuda")


def load(path: str | Path | None = None, device: str = "auto", ctx: int | None = None,
         fuse: bool = True, progress: bool = True, log=None, quant: str | None = None,
         kv: str = "bf16") -> "Model":
    """Open a checkpoint (HF folder or .gguf file; None means the embedded default model), build its
    graph and an engine on `device` ("auto", "cpu" or "cuda") with a KV cache of `ctx` tokens.
    On the GPU a GGUF's quantized matrices stay quantized; `quant` "bf16" takes them to bf16,
    "q8" / "q4" quantize a checkpoint's other matrices on load. The CPU runs float32 holding the
    same values (bf16-rounded, or quantized and dequantized), so quality is measured there too.
    `kv` is the KV cache's dtype: "bf16", "fp8" (e4m3, a scale per token and KV head), or "auto"
    (fp8 for contexts beyond 8192 positions, bf16 within)."""
    from .models import build_graph
    from .loading.checkpoint import open_checkpoint   # deferred: heavy imports (gguf, tokenizers)
    from .loading.default_model import default_model_path

    log = log or sys.stderr   # looked up per call, so redirected stderr (tests) is honoured
    if device not in DEVICES:
        raise FuselmError(f"device must be one of {', '.join(DEVICES)}, got '{device}'")
    if ctx is not None and ctx <= 0:
        raise FuselmError(f"ctx must be a positive number of tokens, got {ctx}")
    resolve_kv(kv, 1)   # a bad value fails before the checkpoint is read
    if path is None:
        path = default_model_path(auto_pull=True, log=log)
    elif not Path(path).exists():
        raise FuselmError(f"no such file or folder: {path}")
    ckpt = open_checkpoint(str(path))
    cfg = ckpt.config
    if ctx is not None and ctx > cfg.max_position_embeddings:
        raise FuselmError(f"ctx {ctx} is beyond the model's {cfg.max_position_embeddings} positions "
                          f"(max_position_embeddings of {cfg.source or path})")
    ctx = ctx or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
    graph = build_graph(cfg, ctx)   # Phi-3's LongRoPE picks its factors by the context
    engine = _make_engine(device, graph, ckpt, ctx, fuse, progress, log, quant, resolve_kv(kv, ctx))
    return Model(ckpt, engine, Path(path))


def _gpu_name() -> str | None:
    """The name of GPU 0, or None when there is no usable GPU (no CuPy, no driver, no device)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:   # CuPy raises several types when the driver or device is missing
        return None


def _make_engine(device: str, graph, ckpt, ctx: int, fuse: bool, progress: bool = True,
                 log=None, quant: str | None = None, kv: str = "bf16") -> Engine:
    """The one place that picks a backend: CUDA when asked for (or on "auto" when a GPU and the
    CUDA engine are present), else the CPU reference executor."""
    log = log or sys.stderr
    if device in ("auto", "cuda"):
        gpu = _gpu_name()
        cuda_engine, why = None, "no GPU found"
        if gpu is not None:
            try:
                from .runtime.cuda_engine import CudaEngine as cuda_engine
            except ImportError as e:
                why = f"GPU {gpu} found but the CUDA engine cannot be imported ({e})"
        if cuda_engine is not None:
            print(f"using GPU: {gpu}", file=log)
            return cuda_engine.from_checkpoint(ckpt, graph, ctx=ctx, fuse=fuse, quant=quant, progress=progress, kv=kv)
        if device == "cuda":
            raise FuselmError(f"--device cuda: {why}")
        print(f"{why}, running on the CPU", file=log)
    from .runtime.cpu_engine import CpuEngine
    return CpuEngine.from_checkpoint(ckpt, graph, ctx, progress=progress, quant=quant, kv=kv)


def default_sampling(generation: dict | None) -> SamplingParams:
    """Sampling settings from the checkpoint's generation_config.json; greedy when it does not ask
    for sampling (or there is none)."""
    g = generation or {}
    params = SamplingParams(repetition_penalty=float(g.get("repetition_penalty") or 1.0))
    if g.get("do_sample"):
        params = SamplingParams(temperature=float(g.get("temperature", 1.0)),
                                top_k=int(g.get("top_k") or 0), top_p=float(g.get("top_p") or 1.0),
                                min_p=float(g.get("min_p") or 0.0),
                                repetition_penalty=params.repetition_penalty)
    return params


class Model:
    """A loaded model: checkpoint, tokenizer and engine. `last_stats` describes the last generation."""

    def __init__(self, ckpt, engine: Engine, path: Path | None = None):
        self.ckpt, self.engine, self.path = ckpt, engine, path
        self.config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.defaults = default_sampling(getattr(ckpt, "generation", None))
        self.last_stats: GenerationStats | None = None
        self._cache_ids: list[int] = []   # ids in the engine's KV cache, for multi-turn chat

    @property
    def device(self) -> str:
        """Where the model runs: "cuda" or "cpu"."""
        return self.engine.device

    def sampling(self, temperature=None, top_k=None, top_p=None, min_p=None,
                 repetition_penalty=None, seed=None) -> SamplingParams:
        """The model's defaults with the given settings (those not None) replaced; validated."""
        d = self.defaults
        pick = lambda value, default: default if value is None else value  # noqa: E731
        try:
            return SamplingParams(
                temperature=float(pick(temperature, d.temperature)), top_k=int(pick(top_k, d.top_k)),
                top_p=float(pick(top_p, d.top_p)), min_p=float(pick(min_p, d.min_p)),
                repetition_penalty=float(pick(repetition_penalty, d.repetition_penalty)),
                seed=seed).validate()
        except ValueError as e:
            raise FuselmError(str(e)) from None

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, *, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None,
                 chat: bool = False) -> Iterator[str]:
        """Stream the continuation of `prompt`, text or token ids (with chat=True: the answer to
        the text as a user message, through the chat template). Sampling settings left as None
        take the model's defaults (`self.defaults`). Starts from an empty cache."""
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repetition_penalty=repetition_penalty, seed=seed)
        self._cache_ids.clear()
        if chat:
            if not isinstance(prompt, str):
                raise FuselmError("chat=True takes the prompt as text, not token ids")
            return self.chat([{"role": "user", "content": prompt}], max_new_tokens, **sampling)
        return self._generate(prompt, max_new_tokens, None, sampling)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 64, *,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None, repetition_penalty: float | None = None,
             seed: int | None = None) -> Iterator[str]:
        """Stream the assistant's reply to `messages` (dicts with "role" and "content"). When the
        messages extend the previous chat, the cached tokens are reused instead of fed again."""
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repetition_penalty=repetition_penalty, seed=seed)
        return self._generate(list(messages), max_new_tokens, self._cache_ids, sampling)

    def fit_chat(self, messages: Sequence[dict], max_new_tokens: int) -> tuple[list[dict], int]:
        """`messages` without their oldest turns, as many as must go for the chat plus
        `max_new_tokens` to fit the context, and how many messages were dropped. A leading system
        message and the last message stay; when even they do not fit, chat() says so."""
        kept = list(messages)
        head = 1 if kept and kept[0].get("role") == "system" else 0
        dropped = 0
        fits = lambda m: len(encode_prompt(self.tokenizer, m)) + max_new_tokens <= self.engine.max_context  # noqa: E731
        while len(kept) - head > 1 and not fits(kept):
            del kept[head]
            dropped += 1
            # a turn is a user message and the replies after it: the history starts with a user again
            while len(kept) - head > 1 and kept[head].get("role") != "user":
                del kept[head]
                dropped += 1
        return kept, dropped

    def reset(self) -> None:
        """Forget the cached conversation."""
        self._cache_ids.clear()
        self.engine.reset()

    def _generate(self, prompt, max_new_tokens, cache_ids, sampling) -> Iterator[str]:
        self.last_stats = GenerationStats()
        return generate(self.engine, self.tokenizer, prompt, max_new_tokens,
                        self.sampling(**sampling), self.last_stats, cache_ids)
