"""Rendering Hugging Face chat templates (Jinja) with the environment transformers gives them."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import FuselmError


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


def compile_template(source: str, origin: str | Path | None = None) -> jinja2.Template:
    """The compiled template: sandboxed, trim_blocks and lstrip_blocks on, as transformers does.
    A syntax error is one line naming `origin`, the file the template came from (where given)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        where = f"{origin}: " if origin else ""
        raise FuselmError(f"{where}chat template: syntax error on line {e.lineno}: {e.message}") from None


def render(template: jinja2.Template, messages: list[dict], add_generation_prompt: bool,
           special_tokens: dict, **kwargs) -> str:
    """Render `messages` through a template from compile_template; message keys whose value is None
    are dropped, as transformers does."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    context = {**special_tokens, "tools": None, "documents": None, **kwargs}
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as e:
        raise FuselmError(f"chat template: {' '.join(str(e).split())}") from None
