"""`fuselm serve`: load a model, then serve it over HTTP until Ctrl-C.

The port is bound before the model loads, so a port in use fails at once with one line, and
clients that connect during the load wait in the listen queue instead of being refused.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from ..dsl.kv_dtype import KV_DTYPES
from ..errors import FuselmError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`fuselm serve`'s options."""
    p.add_argument("model", nargs="?", help="HF checkpoint folder or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct, pulled if needed)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; "
                   "0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to run: cuda, cpu, or auto (the GPU when there is one; default)")
    p.add_argument("--ctx", type=int, metavar="N", help="context length (KV cache rows), at most the "
                   "model's maximum positions; default min(model's maximum, 4096)")
    p.add_argument("--kv", choices=KV_DTYPES, default="bf16",
                   help="the KV cache's dtype: bf16 (default) or fp8 (e4m3 with a scale per token and KV head)")
    p.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests queued for the engine before new ones get 503 (default 256)")
    p.add_argument("--max-seqs", type=int, metavar="N",
                   help="requests generated together in one continuous batch (default 8 on the CPU, 64 on "
                   "the GPU)")
    p.add_argument("--kv-memory", type=float, metavar="GiB",
                   help="memory of the batch's KV page pool (default: room for --max-seqs full contexts; on "
                   "the GPU at most 80%% of its free memory)")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or a one-line FuselmError."""
    if not 0 <= port <= 65535:
        raise FuselmError(f"--port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise FuselmError(f"cannot listen on {host}:{port} ({reason})") from None


def url_of(sock: socket.socket) -> str:
    """The base URL of the API behind `sock`."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(app, sock: socket.socket, what: str) -> None:
    """Serve `app` on `sock` until interrupted, once "serving {what} at URL" is printed."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    print(f"serving {what} at {url_of(sock)} (Ctrl-C stops)", file=sys.stderr, flush=True)
    server.run(sockets=[sock])


def main(args: argparse.Namespace) -> int:
    """Bind, load the model, print the URL, serve until interrupted."""
    if args.max_waiting < 1:
        raise FuselmError(f"--max-waiting must be at least 1, got {args.max_waiting}")
    if args.max_seqs is not None and args.max_seqs < 1:
        raise FuselmError(f"--max-seqs must be at least 1, got {args.max_seqs}")
    if args.kv_memory is not None and not args.kv_memory > 0:
        raise FuselmError(f"--kv-memory must be a positive number of GiB, got {args.kv_memory}")
    if args.ctx is not None and args.ctx <= 0:
        raise FuselmError(f"--ctx must be a positive number of tokens, got {args.ctx}")
    sock = listen(args.host, args.port)
    from ..api import load
    from .app import create_app, served_name
    from .batcher import batches, pages_in
    with sock:
        print(f"loading {args.model or 'the default model'}", file=sys.stderr)
        model = load(args.model, device=args.device, ctx=args.ctx, kv=args.kv)
        pages = None if args.kv_memory is None or not batches(model) else pages_in(model, args.kv_memory)
        app = create_app(model, max_waiting=args.max_waiting, max_seqs=args.max_seqs, kv_pages=pages)
        serve(app, sock, f"{served_name(model)} on {model.device}")
    return 0
