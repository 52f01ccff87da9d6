"""Structured output: a request's `response_format` (`json_object`, `json_schema`) as a grammar
that llguidance turns into a mask of the token ids allowed next; the batch scheduler's sampler
keeps only those (runtime/sampling.py, `allowed`).

    grammars = Grammars(tokenizer)             # llguidance's view of the vocabulary, built once
    grammar = grammars.compile(response_format)    # APIError 400 naming response_format if invalid
    constraint = grammars.constraint(grammar)      # per request: allowed(width), accept(token)

Once the grammar is complete, only the stop ids are allowed, so the answer ends there.
"""
from __future__ import annotations

import json
import threading

import numpy as np

from .errors import APIError
from .schemas import ResponseFormat

FIELD = "response_format"


class Constraint:
    """One request's grammar state."""

    def __init__(self, matcher):
        self._matcher = matcher

    def allowed(self, width: int) -> np.ndarray:
        """[width] bool: the ids that may come next (ids past the grammar's vocabulary may not)."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), np.uint8), bitorder="little")
        out = np.zeros(width, bool)
        n = min(width, bits.size)
        out[:n] = bits[:n].astype(bool)
        return out

    def accept(self, token: int) -> None:
        """Advance past `token` (one the mask allowed)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")


class Grammars:
    """Grammars over one tokenizer (a TextTokenizer: its backend and stop ids)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll = None

    @property
    def _lltokenizer(self):
        """llguidance's tokenizer, built on first use (about 0.3 s for a 50k vocabulary)."""
        with self._lock:
            if self._ll is None:
                import llguidance
                tok = self._tokenizer
                self._ll = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=sorted(tok.stop_ids))
            return self._ll

    def compile(self, fmt: ResponseFormat) -> str | None:
        """The grammar of `fmt` (None for plain text); APIError 400 when llguidance refuses it."""
        import llguidance
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            schema = {"type": "object"}
        elif fmt.json_schema is None:
            raise APIError(400, "response_format: type json_schema needs a json_schema object", FIELD)
        else:
            schema = fmt.json_schema.schema_
        try:
            # compact JSON: a model that drifts cannot fill its answer with whitespace
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                    defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise APIError(400, f"response_format: the schema is not valid: {_one_line(e)}", FIELD) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer)
        if error and not error.startswith("WARNING"):
            raise APIError(400, f"response_format: the schema is not supported: {_one_line(error)}", FIELD)
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        """A fresh state of `grammar` (one compile() returned) for one request."""
        import llguidance
        matcher = llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise APIError(400, f"response_format: {_one_line(matcher.get_error())}", FIELD)
        return Constraint(matcher)


def _one_line(e) -> str:
    return " ".join(str(e).split())[:300]
