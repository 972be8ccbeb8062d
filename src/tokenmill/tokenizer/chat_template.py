"""Chat templates rendered as Hugging Face transformers renders them, with jinja2 alone.

The template sees what ``apply_chat_template`` gives it: ``messages``, ``tools``,
``documents``, ``add_generation_prompt`` and the tokenizer's special tokens by name
(``bos_token``, ``eos_token``, ...), in a sandbox that trims blocks and whitespace as
transformers does, with its helpers: ``raise_exception``, ``strftime_now``, a ``tojson``
that keeps non-ASCII text, loop controls (``break``/``continue``), and the ``generation``
block (rendered as its body). A template that fails to parse raises ``ValueError``; one
that calls ``raise_exception`` (a conversation it rejects) raises ``jinja2.TemplateError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks an assistant turn for training
    masks; rendering keeps its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reach into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """One compiled template. Invariant: never mutated after construction, so one
    instance may render on several threads at once."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            names = jinja2.meta.find_undeclared_variables(environment.parse(source))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template is not valid Jinja: {e}") from e
        self._special_tokens = dict(special_tokens)
        self.source = source
        # a template that never reads ``tools`` cannot show the model any tool
        self.supports_tools = "tools" in names

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None) -> str:
        return self._template.render(messages=list(messages), tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt,
                                     **self._special_tokens)
