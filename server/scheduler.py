"""The scheduler: a bounded FIFO of generation jobs and one worker thread that owns the model.

`Scheduler` is for an engine that holds one sequence (one KV cache): the worker runs jobs one
after another and switches only at request boundaries. Handlers only `submit_all` a request's
jobs, read its events and `cancel` it; `BatchScheduler` (batcher.py) runs many jobs at once behind the same calls.

Events cross from the worker thread to the event loop through `loop.call_soon_threadsafe`. A
cancelled job stops at the next token: the worker checks its flag between tokens. Every ticket
gets exactly one last event (Finished or Failed), cancelled ones too, so no reader waits forever.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from ..errors import FuselmError
from ..runtime.engine import SamplingParams
from ..runtime.generate import GenerationStats, generate
from .metrics import ServerMetrics
from .stops import StopStrings

log = logging.getLogger("fuselm.server")


@dataclass(frozen=True)
class Job:
    """What to generate: the prompt's token ids (build_jobs encodes text, chat messages and the
    tools they may call once), a token limit, sampling, stop strings;
    `ignore_eos` generates past the model's stop tokens up to the limit (benchmarks); `grammar`
    (structured.py) constrains the answer; `logprobs`: report each token's log probability and
    that many alternatives (None: none); `n` answers to the one prompt; `splitter` parts a
    chat answer into reasoning, content and tool calls."""
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None
    logprobs: int | None = None
    n: int = 1                          # choices, each its own sequence (batching only)
    splitter: Callable | None = None    # chat: a splitter factory (loading/answers.py): reasoning, tool calls


@dataclass(frozen=True)
class Piece:
    """Text of the answer, in order; never part of a stop string. `logprobs`: the TokenLogprobs
    (logprobs.py) of the tokens whose text it completes, where the job asked for them."""
    text: str
    logprobs: tuple = ()
    index: int = 0     # the choice it belongs to


@dataclass(frozen=True)
class Finished:
    """The answer (choice `index`) is complete: finish_reason "stop" (a stop token or string) or
    "length"."""
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    index: int = 0


@dataclass(frozen=True)
class Failed:
    """Generation failed; `message` is one line, safe to show the client."""
    message: str


Event = Piece | Finished | Failed


CANCELLED = Failed("the request was cancelled (its client left, or the server is shutting down)")


class QueueFull(FuselmError):
    """The waiting queue holds as many jobs as it may."""


@dataclass(eq=False)
class Ticket:
    """One submitted job: its events for the event loop that submitted it, and its cancel flag."""
    job: Job
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def emit(self, event: Event) -> None:
        """Hand `event` to the event loop (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:   # the loop is closed: the server is gone, nobody listens
            pass

    async def events(self) -> AsyncIterator[Event]:
        """Pieces as they come, and a Finished for each of the job's choices; or a Failed, last."""
        remaining = self.job.n
        while True:
            event = await self._events.get()
            yield event
            remaining -= isinstance(event, Finished)
            if isinstance(event, Failed) or remaining == 0:
                return


class Request:
    """The tickets of one request's prompts (a completion may have several), read as one: prompt
    p's choice j is choice p * n + j, as OpenAI numbers them, n choices a prompt."""

    def __init__(self, scheduler: "Scheduler", tickets: list[Ticket]):
        self.scheduler, self.tickets = scheduler, tickets
        self.per_prompt = tickets[0].job.n
        self.n = self.per_prompt * len(tickets)

    async def events(self) -> AsyncIterator[Event]:
        """Every ticket's events, re-indexed, as they come; a Failed of any, last."""
        if len(self.tickets) == 1:
            async for event in self.tickets[0].events():
                yield event
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(ticket: Ticket, offset: int) -> None:
            async for event in ticket.events():
                merged.put_nowait(event if isinstance(event, Failed) else
                                  dataclasses.replace(event, index=event.index + offset))
        pumps = [asyncio.create_task(pump(t, p * self.per_prompt)) for p, t in enumerate(self.tickets)]
        remaining = self.n
        try:
            while remaining:
                event = await merged.get()
                yield event
                if isinstance(event, Failed):
                    return
                remaining -= isinstance(event, Finished)
        finally:
            for task in pumps:
                task.cancel()

    def cancel(self) -> None:
        """Cancel every prompt's job (nothing for those that ended)."""
        for ticket in self.tickets:
            self.scheduler.cancel(ticket)


class Scheduler:
    """Runs jobs on `model` (a fuselm Model) one at a time, first come first served, with at most
    `max_waiting` jobs queued behind the running one."""

    def __init__(self, model, max_waiting: int = 256, metrics: ServerMetrics | None = None):
        if max_waiting < 1:
            raise FuselmError(f"max_waiting must be at least 1, got {max_waiting}")
        self.model, self.max_waiting = model, max_waiting
        self.metrics = metrics or ServerMetrics()
        self._waiting: deque[Ticket] = deque()
        self._running: Ticket | None = None
        self._wake = threading.Condition()
        self._closing = False
        self._worker = threading.Thread(target=self._work, name="fuselm-worker", daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._worker.is_alive()

    def start(self) -> None:
        """Start the worker thread."""
        self._worker.start()

    def stop(self) -> None:
        """Cancel every job, waiting or running, and wait for the worker to end."""
        with self._wake:
            self._closing = True
            for ticket in self._running_tickets():
                ticket.cancelled.set()
            for ticket in self._waiting:
                ticket.cancelled.set()
                ticket.emit(CANCELLED)
            self._waiting.clear()
            self.metrics.waiting.set(0)
            self._wake.notify()
        if self._worker.is_alive():
            self._worker.join()

    def _running_tickets(self) -> list[Ticket]:
        return [] if self._running is None else [self._running]

    def submit(self, job: Job) -> Ticket:
        """Queue `job`; call from the event loop that reads the ticket's events. QueueFull when
        `max_waiting` jobs are already waiting."""
        ticket = Ticket(job, asyncio.get_running_loop())
        with self._wake:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"the server is busy: {len(self._waiting)} requests are waiting; retry later")
            self._waiting.append(ticket)
            self.metrics.waiting.set(len(self._waiting))
            self._wake.notify()
        return ticket

    def submit_all(self, jobs: list[Job]) -> Request:
        """Queue the jobs of one request, all or none (QueueFull cancels those queued)."""
        tickets = []
        try:
            for job in jobs:
                tickets.append(self.submit(job))
        except QueueFull:
            for ticket in tickets:
                self.cancel(ticket)
            raise
        return Request(self, tickets)

    def cancel(self, ticket: Ticket) -> None:
        """Stop `ticket`'s job: dropped from the queue if it waits, stopped at the next token if it
        runs, nothing if it has ended."""
        ticket.cancelled.set()
        with self._wake:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                self.metrics.waiting.set(len(self._waiting))
                self.metrics.finished.labels("cancelled").inc()
                ticket.emit(CANCELLED)

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                self._running = ticket = self._waiting.popleft()
                self.metrics.waiting.set(len(self._waiting))
            self.metrics.running.inc()
            try:
                self._run(ticket)
            finally:
                self.metrics.running.dec()
                with self._wake:
                    self._running = None

    def _run(self, ticket: Ticket) -> None:
        """Generate one job to its end, emitting its events; never raises."""
        stats = GenerationStats()
        started = time.perf_counter()
        try:
            outcome = self._generate(ticket, stats)
        except FuselmError as e:   # the model's own one-line errors (non-finite logits, ...)
            ticket.emit(Failed(str(e)))
            outcome = "error"
        except Exception:   # a bug: keep the worker alive, log the traceback, tell the client little
            log.exception("generation failed")
            ticket.emit(Failed("internal error during generation"))
            outcome = "error"
        self._record(ticket, stats, started, outcome)

    def _generate(self, ticket: Ticket, stats: GenerationStats) -> str:
        """Stream the job's pieces to its ticket; return the finish reason, or "cancelled"."""
        job = ticket.job
        stops = StopStrings(job.stop)
        pieces = generate(self.model.engine, self.model.tokenizer, list(job.prompt), job.max_tokens,
                          job.sampling, stats, ignore_eos=job.ignore_eos)
        try:
            for piece in pieces:
                if ticket.cancelled.is_set():
                    ticket.emit(CANCELLED)
                    return "cancelled"
                text, stopped = stops.push(piece)
                if text:
                    ticket.emit(Piece(text))
                if stopped:
                    return self._finish(ticket, stats, "stop")
        finally:
            pieces.close()
        tail = stops.flush()
        if tail:
            ticket.emit(Piece(tail))
        return self._finish(ticket, stats, "stop" if stats.stopped else "length")

    @staticmethod
    def _finish(ticket: Ticket, stats: GenerationStats, reason: str) -> str:
        ticket.emit(Finished(reason, stats.prompt_tokens, stats.generated_tokens))
        return reason

    def _record(self, ticket: Ticket, stats: GenerationStats, started: float, outcome: str) -> None:
        """Count an ended job in the metrics; `started` is when its generation began."""
        m = self.metrics
        m.finished.labels(outcome).inc()
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.generated_tokens.inc(stats.generated_tokens)
        if stats.prompt_tokens:   # the prefill ran: there was a first token
            m.ttft.observe(started - ticket.submitted + stats.ttft_s)
        if stats.decode_steps:
            m.tpot.observe(stats.decode_s / stats.decode_steps)
