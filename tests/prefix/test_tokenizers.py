"""Prompt token ids for prefix matching: the pods' own, a real tokenizer file's, an estimate."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from policyd.extproc.openai import Turn, api_of, prompt_of
from policyd.prefix.tokenizers import (
    EstimateTokenizer,
    HuggingFaceTokenizer,
    SimTokenizer,
    tokenizer_from_spec,
)
from policyd.sim.api import parse_call

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

BODIES: list[tuple[str, dict[str, Any]]] = [
    (COMPLETIONS, {"model": "m", "prompt": "You are a helpful assistant. Say hi, please!"}),
    (COMPLETIONS, {"model": "m", "prompt": ["one prompt in a list"]}),
    (COMPLETIONS, {"model": "m", "prompt": [1, 50, 7, 7, 300]}),
    (
        CHAT,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3+3?"},
            ],
        },
    ),
    (
        CHAT,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Lines:\nend.\n\n:next,"},
                {"role": "user", "content": ""},
                {"role": "assistant", "content": "!"},
            ],
        },
    ),
    (
        CHAT,
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first part"},
                        {"type": "text", "text": "second part"},
                    ],
                }
            ],
        },
    ),
]


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_sim_tokenizer_gives_exactly_the_ids_the_simulated_pod_computes(
    path: str, body: dict[str, Any]
) -> None:
    turns = prompt_of(body, api_of(path))
    pod = parse_call(json.dumps(body).encode(), chat=path == CHAT)
    assert tuple(SimTokenizer().encode(turns)) == pod.prompt


def test_a_batch_of_prompts_is_matched_by_its_first() -> None:
    turns = (Turn(None, ("first prompt",)), Turn(None, ("second prompt",)))
    assert SimTokenizer().encode(turns) == SimTokenizer().encode(turns[:1])
    assert SimTokenizer().encode(()) == []


def test_estimate_gives_one_stable_id_per_four_bytes_and_keeps_prefixes() -> None:
    tokenizer = EstimateTokenizer()
    short = tokenizer.encode((Turn(None, ("abcdefgh",)),))
    assert len(short) == 2 and short[0] != short[1]
    long = tokenizer.encode((Turn(None, ("abcdefgh and more é!",)),))
    assert long[:2] == short and len(long) == 6  # 21 UTF-8 bytes, the tail padded
    system = Turn("system", ("A long shared system prompt.",))
    one = tokenizer.encode((system, Turn("user", ("question one",))))
    two = tokenizer.encode((system, Turn("user", ("another question",))))
    common = len("system: A long shared system prompt.\nuser: ") // 4
    assert one[:common] == two[:common] and one != two
    assert tokenizer.encode((Turn(None, (), (5, 6, 7)),)) == [5, 6, 7]


def _tokenizer_file(directory: Path) -> Path:
    """A word-level tokenizer with a BOS post-processor, built with the library itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "hello", "world", "system", "user", ":", "be", "brief", "hi"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_a_hugging_face_tokenizer_file_encodes_with_its_special_tokens(tmp_path: Path) -> None:
    path = _tokenizer_file(tmp_path)
    tokenizer = tokenizer_from_spec(f"hf:{path}")
    assert isinstance(tokenizer, HuggingFaceTokenizer) and tokenizer.name == f"hf:{path}"
    assert tokenizer.encode((Turn(None, ("hello world",)),)) == [1, 2, 3]
    assert tokenizer.encode((Turn(None, ("hello nonsense",)),)) == [1, 2, 0]
    chat = (Turn("system", ("be brief",)), Turn("user", ("hi",)))
    # No chat template beside the file: rendered as the simulator does ("system: be brief\n...").
    assert tokenizer.encode(chat) == [1, 4, 6, 7, 8, 5, 6, 9]
    assert tokenizer.encode((Turn(None, (), (9, 9)),)) == [9, 9]


def test_a_bad_tokenizer_file_or_a_missing_package_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load the tokenizer file"):
        HuggingFaceTokenizer(bad)
    good = _tokenizer_file(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(RuntimeError, match="policyd\\[tokenizers\\]"):
        HuggingFaceTokenizer(good)


def test_specs_name_the_tokenizers() -> None:
    assert isinstance(tokenizer_from_spec("sim"), SimTokenizer)
    assert isinstance(tokenizer_from_spec("estimate"), EstimateTokenizer)
    for spec in ("", "hf:", "gpt2", "SIM"):
        with pytest.raises(ValueError, match="sim, estimate or hf:PATH"):
            tokenizer_from_spec(spec)
