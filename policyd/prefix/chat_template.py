"""A model's chat template, rendered as vLLM renders a chat request's messages.

vLLM renders a chat completion with the served model's chat template through
transformers' ``apply_chat_template`` (``vllm/entrypoints/chat_utils.py``,
``apply_hf_chat_template``): a message's text parts joined with newlines, the
generation prompt on (the request's default), the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as template variables. The template is
Jinja, run by transformers in ``jinja2``'s immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``generation`` block tag, a ``tojson`` filter that does not escape HTML and the
globals ``raise_exception`` and ``strftime_now``. This module renders the same
way, so the text (and so the token ids) equal the pod's.

The template comes from the model's files beside its ``tokenizer.json``:
``chat_template.jinja`` when there is one (transformers prefers it), else the
``chat_template`` of ``tokenizer_config.json``. A template is operator input and
a request's messages are client input: both run in the sandbox (no attribute
of Python's internals, no mutation of the messages), and a render stops with
``ChatTemplateError`` once its output passes a bound set by the messages' own
size. What a client controls is the messages, so a template grows its output
with them by at most its own constant factors; a template that loops or
repeats by large constants of its own is the operator's, and the pods,
rendering the same template, would suffer it first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE: Final = "chat_template.jinja"
CONFIG_FILE: Final = "tokenizer_config.json"
DEFAULT_TEMPLATE: Final = "default"  # the name transformers uses among a list of templates
# The special tokens transformers hands a template by name (its special_tokens_map).
SPECIAL_TOKENS: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_MAX_FILE_BYTES: Final = 32 << 20  # a tokenizer_config.json is kilobytes; an added-token table MBs
# A render may add this much text to the messages' own, plus a per-message allowance: a
# template's headers and a system preamble are short, a runaway loop is not.
_OUTPUT_ALLOWANCE: Final = 64 << 10
_OUTPUT_PER_MESSAGE: Final = 1 << 10


class ChatTemplateError(ValueError):
    """A template that cannot be loaded, or a render that failed or passed its bound."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text; renders as is.

    transformers uses the block to find the assistant's tokens for training;
    rendering a prompt ignores it, but a template using it must still parse.
    """

    tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Plain json.dumps, as transformers' filter: Jinja's own escapes <, >, & and '.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)  # the host's local time, as transformers renders


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """One model's chat template with its special tokens, ready to render messages."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], origin: str) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(
                f"the chat template of {origin} does not parse: {error}"
            ) from error
        self._special_tokens = dict(special_tokens)
        self.origin = origin

    @classmethod
    def beside(cls, tokenizer_file: Path) -> ChatTemplate | None:
        """The template of the model whose ``tokenizer.json`` is ``tokenizer_file``, if any."""
        directory = tokenizer_file.parent
        config_path = directory / CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            loaded = json.loads(_read(config_path))
            if not isinstance(loaded, dict):
                raise ChatTemplateError(f"{config_path} is not a JSON object")
            config = loaded
        template_path = directory / TEMPLATE_FILE
        if template_path.is_file():
            return cls(_read(template_path), _special_tokens(config), str(template_path))
        source = _template_of(config.get("chat_template"), config_path)
        if source is None:
            return None
        return cls(source, _special_tokens(config), str(config_path))

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text of chat ``messages``, the generation prompt included."""
        limit = (
            _OUTPUT_ALLOWANCE
            + _OUTPUT_PER_MESSAGE * len(messages)
            + sum(len(message["role"]) + len(message["content"]) for message in messages)
        )
        pieces: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(
                **self._special_tokens,
                messages=[dict(message) for message in messages],
                tools=None,
                documents=None,
                add_generation_prompt=True,
            ):
                size += len(piece)
                if size > limit:
                    raise ChatTemplateError(f"the chat template rendered over {limit} characters")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except Exception as error:  # template code may raise any Python error on a client's data
            raise ChatTemplateError(f"the chat template failed: {error}") from error
        return "".join(pieces)


def _read(path: Path) -> str:
    with path.open("rb") as file:
        data = file.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ChatTemplateError(f"{path} is over {_MAX_FILE_BYTES} bytes")
    return data.decode("utf-8")


def _template_of(value: object, config_path: Path) -> str | None:
    """The ``chat_template`` field: a string, or a list of named templates (the default one)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == DEFAULT_TEMPLATE:
                template = entry.get("template")
                if isinstance(template, str):
                    return template
    raise ChatTemplateError(
        f"the chat_template of {config_path} is neither a string nor a list with a default"
    )


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens a config sets: strings, or added-token objects' content."""
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
