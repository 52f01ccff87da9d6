"""The FastAPI app over one loaded model: OpenAI's completion endpoints, models, health, metrics.

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        prompts (strings or token ids, one or a batch) continued
    GET  /v1/models             the one model served
    GET  /health                200 while the worker runs
    GET  /metrics               Prometheus text

Handlers validate (schemas, jobs), submit a Job per prompt to the Scheduler and turn their events
into a JSON response or server-sent events ending in `data: [DONE]`. A client that goes away
cancels its jobs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Response
from fastapi import Request as HTTPRequest
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ..codegen.build import NoBatchSteps
from .batcher import BatchScheduler, batches
from .errors import APIError, install_error_handlers
from .jobs import build_jobs
from .metrics import ServerMetrics
from .replies import Answer, ChatReply, CompletionReply, Reply
from .scheduler import Finished, Piece, QueueFull, Request, Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, ModelCard, ModelList

log = logging.getLogger("fuselm.server")

DONE = format_sse_event(data_str="[DONE]")


def served_name(model) -> str:
    """The id clients name the model by: its file's name without the extension, or its folder's."""
    path = Path(model.path) if model.path is not None else None
    if path is None:
        return "fuselm"
    return path.stem if path.is_file() else path.name


def create_app(model, model_name: str | None = None, max_waiting: int = 256, max_seqs: int | None = None,
               kv_pages: int | None = None) -> FastAPI:
    """An ASGI app serving `model` (a fuselm Model) under `model_name` (default: served_name),
    with at most `max_waiting` requests queued. Where the engine batches (`batches`), up to
    `max_seqs` requests (default: 8 on the CPU, 64 on the GPU) run together over `kv_pages` KV
    pages (default: room for `max_seqs` full contexts, on the GPU within 80% of its free
    memory); else (or where the compiler has no batch kernels for the model) one at a time. The
    worker thread starts and stops with the app's lifespan;
    `app.state.scheduler` is the Scheduler."""
    name = model_name or served_name(model)
    metrics = ServerMetrics()
    scheduler, batching = None, batches(model)
    if batching:
        try:
            scheduler = BatchScheduler(model, max_waiting, metrics, max_seqs=max_seqs, pages=kv_pages)
        except NoBatchSteps as e:   # the compiler has no batch kernels for this model: serve it serially
            log.warning("continuous batching is off: %s; requests run one at a time", e)
            batching = False
    scheduler = scheduler or Scheduler(model, max_waiting, metrics)
    card = ModelCard(id=name, created=int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="fuselm", lifespan=lifespan)
    app.state.scheduler = scheduler
    install_error_handlers(app)

    async def answer(request: HTTPRequest, body: GenerationRequest, reply_of: type[Reply]):
        if body.model != name:
            raise APIError(404, f"model '{body.model}' is not served here; this server runs '{name}'",
                           "model", "model_not_found")
        # the chat template and a schema's grammar may take a while
        jobs = await run_in_threadpool(build_jobs, model, body, getattr(scheduler, "grammars", None), batching)
        reply = reply_of(name, with_logprobs=jobs[0].logprobs is not None, splitter=jobs[0].splitter,
                         per_prompt=jobs[0].n)
        try:
            submitted = scheduler.submit_all(jobs)
        except QueueFull as e:
            raise APIError(503, str(e), code="server_busy", type="server_error") from None
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            # Cancelling is a no-op for jobs that ended; the background task also covers a
            # disconnect that the generator's `finally` does not see.
            return EventSourceResponse(stream_events(submitted, reply, usage),
                                       background=BackgroundTask(submitted.cancel))
        return await collect(request, submitted, reply)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
        """A chat completion of `messages`, whole or streamed."""
        return await answer(request, body, ChatReply)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        """A completion of each of `prompt`'s prompts, whole or streamed."""
        return await answer(request, body, CompletionReply)

    @app.get("/v1/models")
    async def models() -> ModelList:
        """The model this server runs."""
        return ModelList(data=[card])

    @app.get("/health")
    async def health():
        """200 while the worker thread runs, else 503."""
        if not scheduler.alive:
            raise APIError(503, "the generation worker is not running", code="worker_down", type="server_error")
        return {"status": "ok", "model": name}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """The Prometheus metrics."""
        return Response(metrics.exposition(), media_type=metrics.content_type)

    return app


def _sse(item: BaseModel) -> bytes:
    return format_sse_event(data_str=item.model_dump_json())


async def stream_events(submitted: Request, reply: Reply, include_usage: bool):
    """The server-sent events of one streamed request; leaving early cancels its jobs."""
    try:
        for index in range(submitted.n):
            opening = reply.opening(index)
            if opening is not None:
                yield _sse(opening)
        dones = []
        async for event in submitted.events():
            if isinstance(event, Piece):
                yield _sse(reply.chunk(event.text, event.logprobs, event.index))
            elif isinstance(event, Finished):
                yield _sse(reply.closing(event))
                dones.append(event)
                if include_usage and len(dones) == submitted.n:
                    yield _sse(reply.usage_chunk(dones))
            else:
                error = APIError(500, event.message, type="server_error")
                yield format_sse_event(data_str=json.dumps(error.body()))
        yield DONE
    finally:
        submitted.cancel()


async def _cancel_on_disconnect(http: HTTPRequest, submitted: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
    submitted.cancel()


async def collect(http: HTTPRequest, submitted: Request, reply: Reply) -> BaseModel:
    """The whole response of one request; a client that disconnects first cancels its jobs."""
    watcher = asyncio.create_task(_cancel_on_disconnect(http, submitted))
    try:
        n = submitted.n
        parts, logprobs, dones = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        async for event in submitted.events():
            if isinstance(event, Piece):
                parts[event.index].append(event.text)
                logprobs[event.index] += event.logprobs
            elif isinstance(event, Finished):
                dones[event.index] = event
                if all(dones):
                    return reply.whole([Answer("".join(p), d, lp) for p, d, lp in zip(parts, dones, logprobs)])
            else:
                raise APIError(500, event.message, type="server_error")
    finally:
        watcher.cancel()
        submitted.cancel()
