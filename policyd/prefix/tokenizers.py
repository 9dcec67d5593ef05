"""The token ids of a request's prompt, as a pod would cut it into KV blocks.

Prefix matching needs the ids the pod computes: in precise mode exactly (the
index holds the pods' own token ids), in approximate mode only consistently
(equal prompt prefixes must give equal leading ids). Three tokenizers:

- ``sim``: the simulated pods' own tokenizer (``policyd.prefix.simulated``, which
  the simulator imports), so the ids are exactly theirs;
- ``hf:PATH``: a real model's Hugging Face ``tokenizers`` JSON file (its
  ``tokenizer.json``, or the directory holding it) and its chat template
  (``policyd.prefix.chat_template``), so the ids are a vLLM pod's;
- ``estimate``: no vocabulary at all, one pseudo-id per four UTF-8 bytes, for
  approximate mode when nothing else is configured.

A prompt is a sequence of turns (``TurnLike``, which the serving path's
``Turn`` satisfies). Bare input (``role`` None: a completions prompt, an
embeddings input) is encoded as it is; a list of prompts is a batch of separate
sequences on the pod, and its first prompt stands for the request. Chat turns
are rendered to one text first: with the model's chat template for ``hf:``,
else as the simulator renders them. Token-id prompts are the ids as given.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from policyd.prefix.chat_template import ChatTemplate, ChatTemplateError
from policyd.prefix.simulated import BOS_TOKEN, render_chat, tokenize

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HfTokenizer

_log = logging.getLogger(__name__)

_ESTIMATE_BYTES: Final = 4  # bytes per estimated token, the serving path's four-characters rule
_CACHED_LINES: Final = 256  # message lines whose simulator ids are kept (~65 kB for 1,500 words)


class TurnLike(Protocol):
    """One piece of a prompt, in order (``policyd.extproc.openai.Turn`` is one)."""

    @property
    def role(self) -> str | None: ...  # None: bare input; "": a message naming no role

    @property
    def texts(self) -> tuple[str, ...]: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...


class Tokenizer(Protocol):
    """Turns a prompt into the token ids whose full blocks a pod caches."""

    @property
    def name(self) -> str: ...  # "sim", "estimate", "hf:<path>"

    def encode(self, turns: Sequence[TurnLike]) -> list[int]: ...


def _encode_turns(turns: Sequence[TurnLike], text_ids: Callable[[str], list[int]]) -> list[int]:
    """The one walk over a prompt's shapes that every tokenizer shares."""
    if not turns:
        return []
    first = turns[0]
    if first.role is None:
        if first.token_ids:
            return list(first.token_ids)
        return text_ids(" ".join(first.texts))
    return text_ids(render_turns(turns))


def render_turns(turns: Sequence[TurnLike]) -> str:
    """Chat turns as the simulator's chat template renders them: ``role: content`` lines.

    A message's text parts are joined with spaces, as the simulator joins them;
    a message without a role renders with an empty one.
    """
    return render_chat({"role": turn.role or "", "content": " ".join(turn.texts)} for turn in turns)


class SimTokenizer:
    """Exactly the simulated pods' token ids (``policyd.prefix.simulated``, ``policyd.sim.api``).

    The simulator gives one id per word or mark, never across whitespace, and
    renders each message as one line, so a chat prompt's ids are the BOS and
    each message line's ids in turn. Lines are remembered (the last
    ``_CACHED_LINES``): a shared system prompt or a conversation's history is
    not tokenized again, which is most of a request's cost (~0.3 us a word).
    """

    name: Final = "sim"

    def encode(self, turns: Sequence[TurnLike]) -> list[int]:
        if not turns or turns[0].role is None:
            return _encode_turns(turns, tokenize)
        ids = [BOS_TOKEN]
        for turn in turns:
            ids += _sim_line_ids(render_turns((turn,)))
        return ids


@functools.lru_cache(maxsize=_CACHED_LINES)
def _sim_line_ids(line: str) -> tuple[int, ...]:
    return tuple(tokenize(line)[1:])


class EstimateTokenizer:
    """No vocabulary: one pseudo-id per four UTF-8 bytes (the tail padded with zeros).

    Equal text prefixes give equal leading ids, which is all approximate mode
    needs; the count is the serving path's four-characters estimate. Chat turns
    are rendered as the simulator renders them, so shared leading messages are
    a shared text prefix.
    """

    name: Final = "estimate"

    def encode(self, turns: Sequence[TurnLike]) -> list[int]:
        return _encode_turns(turns, _estimate_ids)


def _estimate_ids(text: str) -> list[int]:
    data = text.encode("utf-8", "surrogatepass")
    data += b"\0" * (-len(data) % _ESTIMATE_BYTES)
    return list(struct.unpack(f"<{len(data) // _ESTIMATE_BYTES}I", data))


class HuggingFaceTokenizer:
    """A real model's tokenizer: its ``tokenizer.json`` and its chat template.

    ``path`` is the ``tokenizer.json`` file or the model directory holding it;
    the chat template is read beside it (``ChatTemplate.beside``). Bare input is
    encoded with the tokenizer's special tokens (a BOS where the model adds
    one), as vLLM encodes a completions prompt. Chat turns are rendered with the
    model's template and encoded without added special tokens (the template
    writes them), as vLLM encodes a chat request (``add_special_tokens`` is
    false by default there): the ids are the pod's, so precise mode matches
    chat prompts. A message's text parts are joined with newlines, as vLLM joins
    them. A request the template rejects (``raise_exception``, an error on the
    client's data, an output over the bound) has no ids: the pod rejects it too.

    A model without a chat template renders chat turns as the simulator does
    (``render_turns``) and encodes them like bare input: consistent for
    approximate mode, but no vLLM pod serves chat for it without a template.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415 (an optional extra)
        except ImportError as error:
            raise RuntimeError(
                "a Hugging Face tokenizer needs the `tokenizers` package:"
                " pip install 'policyd[tokenizers]'"
            ) from error
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        try:
            self._tokenizer: HfTokenizer = HfTokenizer.from_file(str(file))
        except Exception as error:  # the library raises a bare Exception for a bad file
            raise ValueError(f"cannot load the tokenizer file {file}: {error}") from error
        try:
            self.chat_template = ChatTemplate.beside(file)
        except (OSError, ValueError) as error:  # ChatTemplateError, bad JSON or UTF-8
            raise ValueError(f"cannot load the chat template beside {file}: {error}") from error
        self.name = f"hf:{path}"

    def encode(self, turns: Sequence[TurnLike]) -> list[int]:
        if self.chat_template is None or not turns or turns[0].role is None:
            return _encode_turns(turns, self._ids)
        messages = [{"role": turn.role or "", "content": "\n".join(turn.texts)} for turn in turns]
        try:
            text = self.chat_template.render(messages)
        except ChatTemplateError as error:
            _log.debug("a chat request has no prefix ids: %s", error)
            return []
        ids: Any = self._tokenizer.encode(text, add_special_tokens=False).ids
        return list(ids)

    def _ids(self, text: str) -> list[int]:
        ids: Any = self._tokenizer.encode(text).ids
        return list(ids)


def tokenizer_from_spec(spec: str) -> Tokenizer:
    """The tokenizer ``--prefix-tokenizer`` names: ``sim``, ``estimate`` or ``hf:PATH``."""
    if spec == SimTokenizer.name:
        return SimTokenizer()
    if spec == EstimateTokenizer.name:
        return EstimateTokenizer()
    if spec.startswith("hf:") and len(spec) > 3:
        return HuggingFaceTokenizer(spec[3:])
    raise ValueError(f"unknown prefix tokenizer {spec!r}: expected sim, estimate or hf:PATH")
