"""Continuous batching: many jobs share every engine step.

The worker owns a batch engine (runtime/batch.py) and its KV page pool (runtime/kv_pages.py).
Each step:

1. admit waiting jobs while the batch has room (`max_seqs`) and the pool has the pages for
   their prompts, after taking the pages of any prompt prefix already in the pool;
2. plan the step: the next token of every sequence that is decoding, then chunks of prompts
   that are being prefilled, up to `step_tokens` tokens in all, so a long prompt goes in over
   several steps and never stalls the streams running beside it;
3. queue it on the engine; meanwhile stream the text of the tokens the step before picked.
   When it is done, pick the next token of each sequence whose fed tokens reach its end
   (appended to its ids at once, so the next step can be planned and queued before their text
   is streamed) and end a sequence at a stop token; a stop string or the token limit ends it
   when its text is streamed, and the step queued for it meanwhile is wasted.
4. plan ahead: while a step runs, the step after it is planned and queued before its picks are
   known, wherever no grammar needs a pick of that step first: those picks (every row is
   picked where the logits are: its argmax, or a draw of the sequence's sampler,
   runtime/sampling.py, logprobs beside it; penalties count the pick still on the engine as
   the row's last fed id) go from the running step's logits straight into the next step's ids
   on the engine, so the engine never waits for the host between steps. A sequence under a
   grammar, or a page that is not free, makes the worker wait for the step instead, as in 3.

A sequence that needs a page when none is left preempts the sequence admitted last: its pages go
back and it waits at the head of the queue to be prefilled again (its published pages usually
still hold its prefix). A cancelled job leaves at the next step boundary and its pages return
at once. Jobs are independent: each has its own sampler (seed) and its own page table.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from ..errors import FuselmError
from ..runtime.batch import Chunk, CpuBatchEngine
from ..runtime.engine import check_logits
from ..runtime.generate import GenerationStats
from ..runtime.kv_pages import PagePool
from ..runtime.sampling import Sampler
from .errors import APIError
from .logprobs import from_engine
from .metrics import ServerMetrics
from .scheduler import CANCELLED, Failed, Finished, Piece, Scheduler, Ticket
from .stops import StopStrings
from .structured import Constraint, Grammars

log = logging.getLogger("fuselm.server")


@dataclass(eq=False)
class Sequence_:
    """One admitted job: its tokens (prompt, then the answer so far), the rows of them in the
    cache (`fed`), its page table, and what turns sampled ids into the job's events."""
    ticket: Ticket
    ids: list[int]
    prompt_tokens: int
    sampler: Sampler
    decoder: object                          # the tokenizer's stream decoder
    stops: StopStrings
    constraint: Constraint | None = None     # response_format's grammar state
    index: int = 0                           # which of its job's choices
    lead: "Sequence_ | None" = None          # a later choice: its job's first, whose prompt pages it takes
    table: list[int] = field(default_factory=list)
    fed: int = 0                             # tokens whose rows are in the cache (steps collected)
    queued: int = 0                          # tokens in steps queued and not yet collected
    awaiting: tuple | None = None            # (step, row): the queued step that picks its next token
    reused: int | None = None                # prompt tokens found in the pool when first placed
    ended: bool = False                      # its last event is sent (a step may still hold it)
    logprobs: list = field(default_factory=list)   # TokenLogprobs of tokens whose text is not sent yet
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache: the prompt's rest while prefilling, then 1 per step."""
        return len(self.ids) - self.fed

    @property
    def decoding(self) -> bool:
        return self.fed >= self.prompt_tokens

    @property
    def picks_ahead(self) -> bool:
        """Whether a step may be fed its next pick before the host sees it (docstring, 4): not
        under a grammar, whose next mask needs that pick first. (Penalties count it on the
        engine: the draw is `pending`.)"""
        return self.constraint is None

    def draw(self, vocab: int, pending: bool = False):
        """What the engine needs to pick its next token from logits of `vocab` ids (None: the
        argmax, and no logprobs); `pending`: its last token is a pick the host has not seen."""
        logprobs = self.ticket.job.logprobs
        if self.constraint is None and logprobs is None and self.sampler.argmax_only:
            return None
        allowed = self.constraint.allowed(vocab) if self.constraint else None
        return self.sampler.draw(self.ids, allowed, logprobs, pending)


def batches(model) -> bool:
    """Whether `model`'s engine can run many requests in one batch (continuous batching): the
    CPU engine, and the CUDA engine on a GPU with bf16 tensor cores (the batch steps' gemms:
    sm_80 on; an fp8 KV cache needs sm_89's conversions, which the engine checked)."""
    from ..runtime.cuda_engine import CudaEngine
    engine = model.engine
    if _on_cpu(model):
        return True
    return isinstance(engine, CudaEngine) and engine.program.target.capability >= 80


def _on_cpu(model) -> bool:
    from ..runtime.cpu_engine import CpuEngine
    return isinstance(model.engine, CpuEngine)


def _engine_class(model):
    """The batch engine that runs beside `model`'s engine."""
    if _on_cpu(model):
        return CpuBatchEngine
    from ..runtime.cuda_batch import CudaBatchEngine
    return CudaBatchEngine


def row_bytes(model) -> int:
    """Bytes of one KV row of `model`'s batch pool over every layer."""
    return _engine_class(model).row_bytes(model.engine.graph, getattr(model.engine, "kv_dtype", "bf16"))


def page_rows(model) -> int:
    """KV rows per page of `model`'s batch engine (its engine class says: fixed on the CPU, what
    the paged attention kernel's passes need on the GPU)."""
    return _engine_class(model).page_rows(model.engine)


def pages_in(model, gib: float, page: int | None = None) -> int:
    """KV pages of `model` (of `page` rows, default page_rows) that `gib` GiB hold; a FuselmError
    when they cannot hold one sequence of the model's context."""
    page = page or page_rows(model)
    pages = int(gib * 2**30) // (row_bytes(model) * page)
    need = -(-model.engine.max_context // page)
    if pages < need:
        raise FuselmError(f"--kv-memory {gib:g} GiB holds {pages} KV pages of {page} rows; one sequence of the "
                          f"context ({model.engine.max_context} tokens) needs {need}: raise it or lower --ctx")
    return pages


GPU_POOL_SHARE = 0.8   # of the GPU's free memory that a default KV pool may take


def default_max_seqs(model) -> int:
    """--max-seqs when not given: 8 on the CPU (each sequence costs it time), 64 on the GPU
    (each step streams the weights once for all of them: the 8B's step of 64 tokens took 8.1 ms
    on an H100 against 7.4 for 32, docs/serving.md)."""
    return 8 if _on_cpu(model) else 64


def default_pages(model, max_seqs: int, page: int) -> int:
    """The pool when --kv-memory is not given: room for `max_seqs` full contexts, on the GPU at
    most GPU_POOL_SHARE of its free memory (but always one full context)."""
    per_seq = -(-model.engine.max_context // page)
    pages = max_seqs * per_seq
    if not _on_cpu(model):
        from ..runtime.cuda_engine import free_device_memory
        fits = int(free_device_memory(model.engine.cp) * GPU_POOL_SHARE) // (row_bytes(model) * page)
        pages = max(per_seq, min(pages, fits))
    return pages


class BatchScheduler(Scheduler):
    """Runs jobs on `model` (a fuselm Model whose engine `batches`) in one continuous batch of at
    most `max_seqs` sequences (default_max_seqs) over a pool of `pages` KV pages (of page_rows
    rows; default_pages), steps of at
    most `step_tokens` tokens (on the GPU at most its largest batch step); at most `max_waiting`
    jobs wait."""

    def __init__(self, model, max_waiting: int = 256, metrics: ServerMetrics | None = None,
                 max_seqs: int | None = None, pages: int | None = None, step_tokens: int = 256):
        super().__init__(model, max_waiting, metrics)
        max_seqs = default_max_seqs(model) if max_seqs is None else max_seqs
        if max_seqs < 1 or step_tokens < 1:
            raise FuselmError(f"max_seqs and step_tokens must be at least 1, got {max_seqs} and {step_tokens}")
        pages = pages or default_pages(model, max_seqs, page_rows(model))
        self.engine = _engine_class(model).beside(model.engine, pages)
        self.engine.warm_up()       # before the first request waits on it
        self.pool = PagePool(pages, self.engine.page)
        self.max_seqs, self.step_tokens = max_seqs, min(step_tokens, getattr(self.engine, "step_tokens", step_tokens))
        self.tokenizer = model.tokenizer
        self.vocab = model.config.vocab_size      # ids of a logits row
        self.grammars = Grammars(model.tokenizer)
        self._active: list[Sequence_] = []            # in admission order
        self._preempted: deque[Sequence_] = deque()   # to admit before any waiting job
        self._siblings: list[Sequence_] = []           # choices 1.. waiting for choice 0's prompt
        self.metrics.kv_pages.set(0)

    def _running_tickets(self) -> list[Ticket]:
        return [s.ticket for s in self._sequences()]

    def _sequences(self) -> list[Sequence_]:
        """Every sequence not ended: running, preempted, or a choice waiting for its first."""
        return [*self._active, *self._preempted, *self._siblings]

    # ---- the worker ----
    def _work(self) -> None:
        queued = deque()    # steps on the engine, oldest first: (handle, planned sequences, launch time)
        while True:
            with self._wake:
                while not (queued or self._waiting or self._sequences() or self._closing):
                    self._wake.wait()
                if self._closing:
                    break
            self._leave_cancelled()
            if len(queued) == 1:      # the next step before this one's picks are known (docstring, 4)
                self._admit()
                if (plan := self._plan(ahead=queued[0][0])) and (step := self._launch(*plan)):
                    queued.append(step)
            picked = self._collect(*queued.popleft()) if queued else []
            if not queued:
                self._admit()
                if (plan := self._plan()) and (step := self._launch(*plan)):
                    queued.append(step)
            self._stream(picked)      # the text of the tokens just picked, while the next step runs
            if not (queued or picked):   # nothing can run now (no pages): wait for a job to come or leave
                with self._wake:
                    self._wake.wait(timeout=0.05)
            self.metrics.running.set(len(self._active))
            self.metrics.kv_pages.set(self.pool.held)
        for handle, _, _ in queued:
            handle.result()           # let them finish before their sequences' pages go
        for seq in self._sequences():
            self._end(seq, "cancelled", CANCELLED)

    def _admit(self) -> None:
        """Move jobs into the batch while there is room and pages (the module docstring, 1). A
        job's choices after the first wait until the first's prompt is in the cache, so that they
        take its pages instead of prefilling the prompt again."""
        ready = [s for s in self._siblings if s.lead.decoding or s.lead.ended]
        if ready:
            self._siblings = [s for s in self._siblings if s not in ready]
            self._preempted.extendleft(reversed(ready))
        while len(self._active) < self.max_seqs:
            if self._preempted:
                seq = self._preempted[0]
            else:
                with self._wake:
                    if not self._waiting:
                        return
                    ticket = self._waiting.popleft()
                    self.metrics.waiting.set(len(self._waiting))
                choices = self._start(ticket)
                if not choices:
                    continue
                seq, *others = choices
                for other in others:
                    other.lead = seq
                self._siblings += others
                self._preempted.appendleft(seq)     # the head of the line until it is in
            if not self._place(seq):
                return
            self._preempted.popleft()
            self._active.append(seq)

    def _start(self, ticket: Ticket) -> list[Sequence_]:
        """The sequences of `ticket`'s choices (a seed s gives choice i the seed s + i), or none
        when its job ended before it began."""
        if ticket.cancelled.is_set():
            return []                 # cancel() has answered it
        job = ticket.job
        try:
            ids = job.prompt
            choices = []
            for i in range(job.n):
                seed = None if job.sampling.seed is None else job.sampling.seed + i
                constraint = self.grammars.constraint(job.grammar) if job.grammar else None
                choices.append(Sequence_(ticket, list(ids), len(ids), Sampler(replace(job.sampling, seed=seed)),
                                         self.tokenizer.stream(), StopStrings(job.stop), constraint, index=i))
        except (FuselmError, APIError) as e:
            ticket.emit(Failed(str(e)))
            self.metrics.finished.labels("error").inc()
            return []
        return choices

    def _place(self, seq: Sequence_) -> bool:
        """Give `seq` the pages of its tokens: a known prefix shared, the rest fresh. False (and
        nothing taken) when the pool has too few free pages now."""
        shared = self.pool.match(seq.ids, limit=len(seq.ids) - 1)
        fresh = self.pool.allocate(self.pool.pages_for(len(seq.ids)) - len(shared))
        if fresh is None:
            self.pool.release(shared)
            return False
        seq.table, seq.fed = shared + fresh, len(shared) * self.pool.page
        if seq.reused is None:
            seq.reused = seq.fed
        return True

    def _plan(self, ahead=None):
        """This step's (chunks, [(sequence, tokens)] for each, device picks) (docstring, 2), or
        None when there is nothing to feed. With `ahead`, the handle of the step on the engine,
        the step after it (docstring, 4): a sequence whose next token that step picks is fed a
        placeholder that the engine replaces by the pick (device picks: (ahead, [(chunk, row of
        that step)])); None when such a sequence needs its pick on the host or a sequence a page
        that is not free (nothing is preempted while a step runs)."""
        budget, planned, picks = self.step_tokens, [], []
        for seq in [s for s in self._active if s.decoding] + [s for s in self._active if not s.decoding]:
            if budget == 0:
                break
            if seq not in self._active:             # preempted while planning this step
                continue
            start = seq.fed + seq.queued
            if seq.awaiting:                        # (only ahead) the running step picks its next token
                if not seq.picks_ahead:
                    return None
                if seq.stats.generated_tokens + 1 >= seq.ticket.job.max_tokens:
                    continue                        # that pick is its last
                n = 1
            else:
                n = min(len(seq.ids) - start, budget)
                if n == 0:                          # its last token is picked: nothing more to feed
                    continue
            if not self._room_for(seq, start + n, preempt=ahead is None):
                if ahead is not None:
                    return None
                continue
            if seq.awaiting:
                picks.append((len(planned), seq.awaiting[1]))
            planned.append((seq, n))
            budget -= n
        planned = [(s, n) for s, n in planned if s in self._active]    # (picks: none is preempted ahead)
        if not planned:
            return None
        chunks = [Chunk([0] if s.awaiting else s.ids[s.fed + s.queued: s.fed + s.queued + n], s.fed + s.queued, s.table)
                  for s, n in planned]
        # the draws of the rows that pick a token (their chunk ends what the sequence knows)
        draws = [s.draw(self.vocab, pending=bool(s.awaiting)) if s.awaiting or s.fed + s.queued + n >= len(s.ids)
                 else None for s, n in planned]
        return chunks, planned, (ahead, picks) if picks else None, draws if any(draws) else None

    def _room_for(self, seq: Sequence_, rows: int, preempt: bool = True) -> bool:
        """Pages for `rows` rows of `seq`, preempting the sequences admitted after it (last
        first) while none is free (unless not `preempt`); False when `seq` itself had to go or
        no page was free to take."""
        while len(seq.table) < self.pool.pages_for(rows):
            page = self.pool.allocate(1)
            if page is not None:
                seq.table += page
                continue
            if not preempt:
                return False
            victim = self._active[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence_) -> None:
        self._active.remove(seq)
        self.pool.release(seq.table)
        seq.table, seq.fed, seq.queued, seq.awaiting = [], 0, 0, None
        self._preempted.appendleft(seq)
        self.metrics.preemptions.inc()
        log.info("preempted a sequence of %d tokens: the KV pool is full", len(seq.ids))

    def _launch(self, chunks: list[Chunk], planned: list[tuple[Sequence_, int]], picks=None, draws=None):
        """Queue one step on the engine (docstring, 3), `picks` fed from the step before it on the
        engine, rows picked by `draws`: (its handle, `planned`, the time), or None when it failed
        (its jobs fail)."""
        try:
            handle = self.engine.launch(chunks, picks, draws)
        except Exception:   # a bug: keep the worker alive, tell the clients little
            self._fail_step(planned)
            return None
        for k, (seq, n) in enumerate(planned):
            seq.queued += n
            if seq.fed + seq.queued >= len(seq.ids):   # its known tokens all fed: this step picks the next
                seq.awaiting = (handle, k)
        return handle, planned, time.perf_counter()

    def _fail_step(self, planned) -> None:
        log.exception("batch step failed")
        for seq, _ in planned:
            self._end(seq, "error", Failed("internal error during generation"))

    def _collect(self, handle, planned: list[tuple[Sequence_, int]], launched_at: float) -> list:
        """Wait for a step and pick the next token of every sequence it completed (ids appended,
        so the next step can be planned at once); [(sequence, token)] for _stream. Sequences
        that ended while it ran are passed over; a failing step fails its jobs."""
        try:
            logits = handle.result()
            finite, best = logits.finite(), logits.picks()   # every row's, in two small copies
        except Exception:
            self._fail_step([(s, n) for s, n in planned if not s.ended])
            return []
        elapsed = time.perf_counter() - launched_at
        picked = []
        for k, (seq, n) in enumerate(planned):
            if seq.ended:
                continue
            seq.fed, seq.queued = seq.fed + n, seq.queued - n
            if seq.awaiting and seq.awaiting[0] is handle:
                seq.awaiting = None
            if seq.decoding and seq.first_token_at is not None:
                seq.stats.decode_steps += 1
                seq.stats.decode_s += elapsed
            if seq.pending:
                self.pool.publish(seq.table, seq.ids[:seq.fed])
                continue
            if not finite[k]:     # nothing sampled, nothing published from garbage
                try:
                    check_logits(logits.row(k), seq.fed - 1)
                except FuselmError as e:
                    self._end(seq, "error", Failed(str(e)))
                continue
            self.pool.publish(seq.table, seq.ids[:seq.fed])
            try:
                token = self._pick(seq, logits, k, int(best[k]))
            except Exception:    # a bug (sampler, grammar): this request fails, the rest go on
                log.exception("sampling failed")
                self._end(seq, "error", Failed("internal error during generation"))
                continue
            if token is not None:
                picked.append((seq, token))
        return picked

    def _pick(self, seq: Sequence_, logits, k: int, token: int) -> int | None:
        """`seq`'s next token, `token`, which the engine picked from row k of the step's `logits`
        (its argmax, or its draw): its sampler and grammar moved past it, its logprobs taken,
        appended to its ids unless it is the last. None (and the sequence ended) at a stop token."""
        job = seq.ticket.job
        seq.sampler.record(token)
        if seq.constraint:
            seq.constraint.accept(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
            seq.stats.prompt_tokens = seq.prompt_tokens - (seq.reused or 0)
            seq.stats.ttft_s = seq.first_token_at - seq.started
        if token in self.tokenizer.stop_ids and not job.ignore_eos:
            seq.stats.stopped = True
            self._finish(seq, "stop")
            return None
        seq.stats.generated_tokens += 1
        if job.logprobs is not None:
            seq.logprobs.append(from_engine(token, *logits.logprobs(k), job.logprobs, self._token_text))
        if seq.stats.generated_tokens < job.max_tokens:
            seq.ids.append(token)
        return token

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _stream(self, picked: list) -> None:
        """Each picked token's text through its sequence's stop strings to its client; a stop
        string or the token limit ends the sequence (a step already queued for it is wasted)."""
        for seq, token in picked:
            if seq.ended:     # (a preempted sequence still streams: its ids keep the token)
                continue
            try:
                piece = seq.decoder.push(token)
                if piece:
                    text, stopped = seq.stops.push(piece)
                    if text:
                        seq.ticket.emit(Piece(text, self._take_logprobs(seq), seq.index))
                    if stopped:
                        self._end(seq, "stop", self._finished(seq, "stop"))
                        continue
                if seq.stats.generated_tokens >= seq.ticket.job.max_tokens:
                    self._finish(seq, "length")
            except Exception:    # a bug (tokenizer, stop strings): this request fails, the rest go on
                log.exception("streaming failed")
                self._end(seq, "error", Failed("internal error during generation"))

    def _finish(self, seq: Sequence_, reason: str) -> None:
        """End `seq` with the text it holds back (a partial character, a possible stop string)."""
        tail, stopped = seq.stops.push(seq.decoder.flush())
        tail += "" if stopped else seq.stops.flush()
        if tail or seq.logprobs and not stopped:   # the last tokens' logprobs, with the text they end
            seq.ticket.emit(Piece(tail, self._take_logprobs(seq), seq.index))
        self._end(seq, "stop" if stopped else reason, self._finished(seq, "stop" if stopped else reason))

    @staticmethod
    def _take_logprobs(seq: Sequence_) -> tuple:
        """The TokenLogprobs of the tokens whose text is now sent."""
        out, seq.logprobs = tuple(seq.logprobs), []
        return out

    @staticmethod
    def _finished(seq: Sequence_, reason: str) -> Finished:
        return Finished(reason, seq.prompt_tokens, seq.stats.generated_tokens, seq.index)

    def _end(self, seq: Sequence_, outcome: str, event) -> None:
        """Take `seq` out of the batch, return its pages, send its last event, count it."""
        seq.ended = True
        if seq in self._active:
            self._active.remove(seq)
        if seq in self._preempted:
            self._preempted.remove(seq)
        if seq in self._siblings:
            self._siblings.remove(seq)
        self.pool.release(seq.table)
        seq.table = []
        self.metrics.kv_pages.set(self.pool.held)
        self.metrics.running.set(len(self._active))
        self._record(seq.ticket, seq.stats, seq.started, outcome)   # before the client can read the metrics
        seq.ticket.emit(event)

    def _leave_cancelled(self) -> None:
        for seq in [s for s in self._sequences() if s.ticket.cancelled.is_set()]:
            self._end(seq, "cancelled", CANCELLED)
