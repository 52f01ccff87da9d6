"""The `fuselm` command line (also `python -m fuselm`).

    fuselm run [MODEL] -p PROMPT -n N [--chat] [sampling options] [--device D] [--ctx N] [--no-fuse] [--quant Q]
    fuselm run [MODEL] -i                   interactive chat (also with no -p on a terminal)
    fuselm pull                             fetch the embedded default model
    fuselm inspect MODEL [--out DIR] [--json] [--compile] [--no-fuse] [--dump DIR]
                                            generated kernels and launch schedule (no GPU)
    fuselm bench [PRESET ...] [--no-fuse]   decode speed vs. the GPU's copy bandwidth
    fuselm trace PRESET [--positions P ...] where a step's time goes between kernels (block timeline)
    fuselm perplexity MODEL TEXT [--ctx N]  llama.cpp's perplexity measure
    fuselm serve [MODEL] [--host H] [--port P] [--device D] [--ctx N] [--max-waiting N] [--max-seqs N] [--kv-memory GiB]
                                            an OpenAI-compatible HTTP server
    fuselm bench-serve URL [--clients 1,32] [--requests R] [--prompt-words W] [--output-tokens T] [--json F]
                                            load a server with concurrent streaming clients

Adding a subcommand: write `add_arguments(parser)` and `handler(args) -> int` in your own module,
then add one line to COMMANDS below, importing your module inside a small wrapper so that
`fuselm run` does not pay for its imports:

    def _bench(args):
        from .tools import bench
        return bench.main(args)
    COMMANDS["bench"] = Command("measure decode speed", bench_add_arguments, _bench)

Handlers raise FuselmError (or ValueError) for the user's mistakes: `main` prints them as one
`error: ...` line on stderr and exits 1; FUSELM_DEBUG=1 shows the traceback instead.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from . import __version__
from .dsl.kv_dtype import AUTO_FP8_FROM, KV_CHOICES
from .errors import FuselmError
from .runtime.engine import SamplingError, SamplingParams
from .runtime.generate import check_text


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """argparse with our error convention: one line, exit code 1."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(1)


# ---- fuselm run -----------------------------------------------------------------------------------

def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """`fuselm run`'s options: the model, the prompt, and sampling overrides."""
    p.add_argument("model", nargs="?", help="HF checkpoint folder or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct, pulled if needed)")
    p.add_argument("-p", "--prompt", help="the prompt; without it: interactive chat on a terminal, "
                   "else the prompt is read from stdin")
    p.add_argument("-n", "--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate at most (default 128)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="multi-turn chat on stdin; when the context fills up, the oldest turns are "
                   "dropped (a system message is kept)")
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json, else greedy)")
    g.add_argument("--temp", type=float, metavar="T", help="temperature; 0 is greedy")
    g.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest tokens; 0: no cut")
    g.add_argument("--top-p", type=float, metavar="P",
                   help="sample among the likeliest tokens whose probabilities sum to P, in (0, 1]")
    g.add_argument("--min-p", type=float, metavar="M",
                   help="drop tokens less likely than M times the likeliest one, in [0, 1)")
    g.add_argument("--repeat-penalty", type=float, metavar="R",
                   help="divide the logits of tokens already seen by R (> 0; 1 is off)")
    g.add_argument("--seed", type=int, metavar="S",
                   help="seed of the sampler, an integer >= 0: the same seed gives the same text")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to run: cuda, cpu, or auto (the GPU when there is one; default)")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (KV cache rows), at most the "
                   "model's maximum positions; default min(model's maximum, 4096)")
    p.add_argument("--no-fuse", action="store_true", help="CUDA: run the graph without fusion")
    add_kv_argument(p)
    p.add_argument("--quant", choices=["bf16", "fp8", "q8", "q5", "q4", "mxfp4"], default=None,
                   help="weights: a GGUF's (or fp8 checkpoint's) quantized matrices stay quantized unless bf16; "
                        "fp8 (e4m3, a scale per row), q8 (Q8_0), q5 (Q5_1) or q4 (Q4_1) quantize the other "
                        "matrices on load, mxfp4 a MoE's expert stacks (the CPU holds the same values)")


# the option of each SamplingParams field, for the messages of its range checks
SAMPLING_OPTIONS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
                    "repetition_penalty": "--repeat-penalty", "seed": "--seed"}


def add_kv_argument(p: argparse.ArgumentParser) -> None:
    """--kv: the KV cache's dtype (run, bench)."""
    p.add_argument("--kv", choices=KV_CHOICES, default="bf16",
                   help="KV cache dtype: bf16, fp8 (e4m3 with a scale per token and KV head: half the bytes), "
                        f"or auto (fp8 for a context beyond {AUTO_FP8_FROM} tokens, bf16 within)")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    named = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                 repetition_penalty=args.repeat_penalty, seed=args.seed)
    return {k: v for k, v in named.items() if v is not None}


def _check_run_arguments(args: argparse.Namespace) -> None:
    """Fail on bad input before the (slow) model load."""
    if args.max_new_tokens <= 0:
        raise FuselmError(f"-n must be a positive number of tokens, got {args.max_new_tokens}")
    if args.ctx is not None and args.ctx <= 0:
        raise FuselmError(f"--ctx must be a positive number of tokens, got {args.ctx}")
    try:
        SamplingParams(**_sampling_kwargs(args)).validate()
    except SamplingError as e:
        raise FuselmError(f"{SAMPLING_OPTIONS[e.param]}: {e}") from None
    if args.model is not None and not Path(args.model).exists():
        raise FuselmError(f"no such file or folder: {args.model}")
    if args.prompt is not None:
        check_text(args.prompt, "-p")
        if not args.prompt.strip():
            raise FuselmError("the prompt is empty")


def _accept_any_bytes_on_stdin() -> None:
    """Decode stdin so that bytes which are not UTF-8 arrive as lone surrogates, which check_text
    then names, instead of a decoding exception that would end an interactive chat."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")


def run(args: argparse.Namespace) -> int:
    """`fuselm run`: one prompt streamed to stdout, or an interactive chat."""
    _check_run_arguments(args)
    _accept_any_bytes_on_stdin()
    prompt = args.prompt
    interactive = args.interactive or (prompt is None and sys.stdin.isatty())
    if prompt is None and not interactive:
        prompt = sys.stdin.read()
        check_text(prompt, "the prompt on stdin")
        if not prompt.strip():
            raise FuselmError("the prompt is empty (give -p, or pipe text on stdin)")

    from .api import load
    print(f"loading {args.model or 'the default model'}", file=sys.stderr)
    model = load(args.model, device=args.device, ctx=args.ctx, fuse=not args.no_fuse, quant=args.quant, kv=args.kv)
    sampling = _sampling_kwargs(args)
    if interactive:
        return chat_loop(model, args.max_new_tokens, sampling)
    split = _splitter(model, [{"role": "user", "content": prompt}]) if args.chat else None
    _stream(model.generate(prompt, args.max_new_tokens, chat=args.chat, **sampling), split)
    print(model.last_stats.summary(), file=sys.stderr)
    return 0


def _splitter(model, messages: list[dict]):
    """A reasoning splitter for the model's answer to `messages` (loading/answers.py), or None."""
    from .loading.answers import splitter_for
    from .runtime.generate import encode_prompt
    make = splitter_for(model.tokenizer, model.tokenizer.decode(encode_prompt(model.tokenizer, messages)[-8:]))
    return make() if make else None


def _stream(pieces, splitter=None) -> str:
    """Print pieces to stdout as they come; return the whole text. With a reasoning `splitter`,
    the reasoning goes to stderr (dimmed on a terminal), the answer to stdout, and only the
    answer is returned."""
    from .loading.answers import CONTENT
    text, dim = [], sys.stderr.isatty()

    def show(kind: str, part: str) -> None:
        if kind == CONTENT:
            text.append(part)
            out = sys.stdout
        else:
            out, part = sys.stderr, f"\x1b[2m{part}\x1b[0m" if dim else part
        out.write(part)
        out.flush()

    for piece in pieces:
        for kind, part in splitter.push(piece) if splitter else [(CONTENT, piece)]:
            show(kind, part)
    for kind, part in splitter.flush() if splitter else []:
        show(kind, part)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


def _line_reader():
    """A function reading one line of chat input ('' at end of input). On a terminal it is
    `input()` with the standard library's readline (arrow keys edit the line and recall history)
    where that exists; elsewhere the prompt goes to stderr and the line is read from stdin."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        try:
            import readline  # noqa: F401  (importing it gives input() line editing)
        except ImportError:  # Windows has no readline: input() still works, unedited
            pass

        def read() -> str:
            try:
                return input("> ") + "\n"
            except EOFError:
                return ""
        return read

    def read() -> str:
        print("> ", end="", file=sys.stderr, flush=True)
        return sys.stdin.readline()
    return read


def chat_loop(model, max_new_tokens: int, sampling: dict) -> int:
    """Multi-turn chat: history kept between turns (the oldest turns dropped once the context is
    full); /reset forgets it, /exit or Ctrl-D leaves."""
    use_template = model.tokenizer.has_chat_template
    print("chat: /reset forgets the conversation, /exit or Ctrl-D leaves"
          + ("; when the context fills up, the oldest turns are dropped" if use_template
             else " (no chat template: each line is a separate prompt)"),
          file=sys.stderr)
    read = _line_reader()
    messages: list[dict] = []
    while True:
        line = read()
        if not line:                    # Ctrl-D / end of input
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if line == "/exit":
            return 0
        if line == "/reset":
            messages.clear()
            model.reset()
            print("(conversation forgotten)", file=sys.stderr)
            continue
        if not line:
            continue
        try:
            check_text(line, "this line")
            if use_template:
                turn, dropped = model.fit_chat(messages + [{"role": "user", "content": line}], max_new_tokens)
                if dropped:
                    print(f"(context full: dropped the oldest {dropped} message{'s' * (dropped != 1)})",
                          file=sys.stderr)
                pieces, split = model.chat(turn, max_new_tokens, **sampling), _splitter(model, turn)
            else:
                pieces, split = model.generate(line, max_new_tokens, **sampling), None
            reply = _stream(pieces, split)
        except FuselmError as e:       # keep the loop and the conversation alive
            print(f"error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:      # stop this reply, keep the chat
            print("\n(interrupted)", file=sys.stderr)
            model.reset()
            continue
        if use_template:
            messages = turn + [{"role": "assistant", "content": reply}]
        print(model.last_stats.summary(), file=sys.stderr)


# ---- fuselm pull ----------------------------------------------------------------------------------

def pull(args: argparse.Namespace) -> int:
    """`fuselm pull`: fetch the embedded default model into the cache; print its path."""
    from .loading.default_model import pull as pull_default
    print(pull_default())
    return 0


# ---- fuselm inspect / bench ----------------------------------------------------------------------

def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    from .tools import inspect
    inspect.add_arguments(p)


def _inspect(args: argparse.Namespace) -> int:
    """`fuselm inspect`: generated kernels and launch schedule of a model (no GPU needed)."""
    from .tools import inspect
    return inspect.main(args)


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from .tools import bench
    bench.add_arguments(p)


def _require_gpu(command: str) -> None:
    """The one-line error of a GPU-only command on a machine without one."""
    from .runtime import cuda_engine
    if not cuda_engine.gpu_available():
        raise FuselmError(f"fuselm {command} needs an NVIDIA GPU (none found)")


def _bench(args: argparse.Namespace) -> int:
    """`fuselm bench`: decode speed against the measured copy bandwidth (needs a GPU)."""
    _require_gpu("bench")
    from .tools import bench
    return bench.main(args)


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    from .tools import trace
    trace.add_arguments(p)


def _trace(args: argparse.Namespace) -> int:
    """`fuselm trace`: the block timeline of decode steps (needs a GPU)."""
    _require_gpu("trace")
    from .tools import trace
    return trace.main(args)


def _perplexity_arguments(p: argparse.ArgumentParser) -> None:
    from .tools import perplexity
    perplexity.add_arguments(p)


def _perplexity(args: argparse.Namespace) -> int:
    """`fuselm perplexity`: llama.cpp's perplexity measure on a text file."""
    from .tools import perplexity
    return perplexity.main(args)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from .server import cli as serve_cli
    serve_cli.add_arguments(p)


def _serve(args: argparse.Namespace) -> int:
    """`fuselm serve`: an OpenAI-compatible HTTP server over one model."""
    from .server import cli as serve_cli
    return serve_cli.main(args)


def _bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    from .tools import bench_serve
    bench_serve.add_arguments(p)


def _bench_serve(args: argparse.Namespace) -> int:
    """`fuselm bench-serve`: concurrent streaming clients against a running server."""
    from .tools import bench_serve
    return bench_serve.main(args)


COMMANDS: dict[str, Command] = {
    "run": Command("generate text from a prompt, or chat", add_run_arguments, run),
    "pull": Command("download the embedded default model (SmolLM2-135M-Instruct)",
                    lambda p: None, pull),
    "inspect": Command("show the kernels and launch schedule generated for a model (no GPU needed)",
                       _inspect_arguments, _inspect),
    "bench": Command("measure decode speed against the GPU's copy bandwidth (needs a GPU)",
                     _bench_arguments, _bench),
    "trace": Command("show when each kernel's blocks start, wait and end inside a decode step (needs a GPU)",
                     _trace_arguments, _trace),
    "perplexity": Command("perplexity of a text file, measured as llama.cpp's llama-perplexity does",
                          _perplexity_arguments, _perplexity),
    "serve": Command("serve a model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions)",
                     _serve_arguments, _serve),
    "bench-serve": Command("load a running OpenAI-compatible server with concurrent streaming clients: "
                           "output tok/s, TTFT and TPOT percentiles", _bench_serve_arguments, _bench_serve),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of COMMANDS."""
    parser = _Parser(prog="fuselm", description="Single-GPU LLM inference with fused CUDA kernels.")
    parser.add_argument("--version", action="version", version=f"fuselm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(handler=cmd.handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fuselm` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (FuselmError, ValueError) as e:
        if os.environ.get("FUSELM_DEBUG") == "1":
            raise
        message = " ".join(str(e).split("\n")) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:            # `fuselm run ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
