"""Rendering Hugging Face chat templates (Jinja) with the environment transformers gives them.

A template comes with the model and is untrusted: it runs in jinja2's immutable sandbox, bounded
in time (MAX_SECONDS, checked on every line the template executes) and in size (MAX_CHARS for the
output and for any string, list or number an operator, filter or call would build).
"""
from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import FuselmError

MAX_SECONDS = 2.0          # a chat template renders in milliseconds
MAX_CHARS = 1 << 23        # 8 Mi characters: far more text than any context holds
MAX_INT_BITS = 1 << 16     # integers of ~20000 digits: arithmetic on them stays fast
_WIDE_FORMAT = re.compile(r"%[-+ #0]*\d{7,}|\{[^{}]*:[^{}]*\d{7,}")   # a field a million or more wide


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we just render it."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &), which templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TooMuch(Exception):
    """Raised inside a render that ran past MAX_SECONDS (from the trace function)."""


def _too_big(value) -> bool:
    """Whether `value` is a string or sequence beyond MAX_CHARS."""
    return isinstance(value, (str, list, tuple)) and len(value) > MAX_CHARS


def _check_args(args, kwargs) -> None:
    """Refuse an integer argument beyond MAX_CHARS: a width or count that would build that much."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
            raise SecurityError(f"argument {a} is too large (at most {MAX_CHARS})")


def _check_format(obj, attribute) -> None:
    """Refuse `str.format` of a format string with a field a million or more wide."""
    if isinstance(obj, str) and attribute in ("format", "format_map") and _WIDE_FORMAT.search(obj):
        raise SecurityError("format with a field width of a million or more")


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's compiler, with every `~` concatenation passed through environment.checked_concat."""

    def visit_Concat(self, node, frame):
        self.write("environment.checked_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with size checks on *, **, +, %, `~`, calls and filters."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                    raise SecurityError(f"'*' would build {len(seq) * n} items (at most {MAX_CHARS})")
            if isinstance(left, int) and isinstance(right, int) \
                    and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise SecurityError(f"'*' would build a number of more than {MAX_INT_BITS} bits")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * left.bit_length() > MAX_INT_BITS:
            raise SecurityError(f"'**' would build too large a number ({left} ** {right})")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > MAX_CHARS:
            raise SecurityError(f"'+' would build {len(left) + len(right)} items (at most {MAX_CHARS})")
        if operator == "%" and isinstance(left, str):
            if _WIDE_FORMAT.search(left):
                raise SecurityError("'%' with a field width of a million or more")
            _check_args(right if isinstance(right, tuple) else (right,), {})    # widths given by '*'
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja's own signature)
        _check_args(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _check_format(obj, attribute)
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _check_format(obj, argument)
        return super().getitem(obj, argument)

    def checked_concat(self, value):
        if _too_big(value):
            raise SecurityError(f"'~' built {len(value)} characters (at most {MAX_CHARS})")
        return value


def _bounded_filter(f):
    """A filter that refuses integer arguments beyond MAX_CHARS (`center(10**9)`)."""
    @functools.wraps(f)   # copies jinja's pass_context / pass_environment marks too
    def bounded(*args, **kwargs):
        _check_args(args[1:], kwargs)
        return f(*args, **kwargs)
    return bounded


def compile_template(source: str, origin: str | Path | None = None) -> jinja2.Template:
    """The compiled template: sandboxed and bounded, trim_blocks and lstrip_blocks on, as
    transformers does. A syntax error is one line naming `origin`, the file the template came from
    (where given)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    where = f"{origin}: " if origin else ""
    if not isinstance(source, str):
        raise FuselmError(f"{where}chat template: not a string (a {type(source).__name__})")
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise FuselmError(f"{where}chat template: syntax error on line {e.lineno}: {e.message}") from None
    except (jinja2.TemplateError, RecursionError, MemoryError, ValueError) as e:
        raise FuselmError(f"{where}chat template: cannot compile ({' '.join(str(e).split())})") from None


def render(template: jinja2.Template, messages: list[dict], add_generation_prompt: bool,
           special_tokens: dict, origin: str | Path | None = None, **kwargs) -> str:
    """Render `messages` through a template from compile_template; message keys whose value is None
    are dropped, as transformers does. Any failure, a template that runs past MAX_SECONDS or
    writes more than MAX_CHARS included, is one line naming `origin`, the template's file."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    context = {**special_tokens, "tools": None, "documents": None, **kwargs}
    where = f"{origin}: " if origin else ""
    try:
        return _bounded_render(template, dict(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **context))
    except _TooMuch as e:
        raise FuselmError(f"{where}chat template: {e}") from None
    except jinja2.TemplateError as e:
        raise FuselmError(f"{where}chat template: {' '.join(str(e).split())}") from None
    except (RecursionError, MemoryError) as e:
        raise FuselmError(f"{where}chat template: {type(e).__name__} (it recurses or builds too much)") from None
    except Exception as e:   # the template's own bugs: TypeError, ZeroDivisionError, KeyError, ...
        raise FuselmError(f"{where}chat template failed: {type(e).__name__}: {' '.join(str(e).split())}") from None


def _bounded_render(template: jinja2.Template, context: dict) -> str:
    """template.render(context) within MAX_SECONDS and MAX_CHARS of output. A trace function
    (for this thread only, restored afterwards) checks the clock on every call and on every line
    of the template's own compiled code, so loops that call nothing are bounded too."""
    deadline = time.monotonic() + MAX_SECONDS

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TooMuch(f"rendering took more than {MAX_SECONDS:g} s")
        return on_line

    def on_call(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TooMuch(f"rendering took more than {MAX_SECONDS:g} s")
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        out, size = [], 0
        for piece in template.generate(context):
            size += len(piece)
            if size > MAX_CHARS:
                raise _TooMuch(f"the output exceeds {MAX_CHARS} characters")
            out.append(piece)
        return "".join(out)
    finally:
        sys.settrace(previous)
