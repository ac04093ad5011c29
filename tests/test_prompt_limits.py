"""The character bound on prompts (issue 26, item 5): it never refuses a prompt that fits, so
every prompt has at least len / max_chars_per_token tokens, whatever its text."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from runtime.tiny_checkpoint import build_tokenizer, save_tokenizer
from tokenizer_manager.prompt_limits import max_chars_per_token, max_prompt_chars


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder: Path = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(build_tokenizer(), folder)
    return AutoTokenizer.from_pretrained(str(folder))


def hostile_texts(tok: Any) -> list[str]:
    """Texts that pack many characters into few tokens: the longest vocabulary entries and
    special tokens repeated, characters NFC composes (one token after composition), random
    Unicode, whitespace runs."""
    vocab = sorted(tok.get_vocab(), key=len)[-20:]
    rng = random.Random(0)
    composed = ["e\u0301", "\u1100\u1161\u11a8", "\u03c9\u0314\u0342\u0345", "A\u030a"]
    return [
        "".join(rng.choice(vocab) for _ in range(2000)),
        "<|im_start|>" * 3000,
        "".join(rng.choice(composed) for _ in range(3000)),
        "".join(chr(c) for c in rng.sample(range(32, 0x2FFFF), 5000) if not 0xD800 <= c < 0xE000),
        " " * 20000,
        "\n" * 20000,
        "the " * 5000,
    ]


def test_every_prompt_has_at_least_chars_over_the_bound_tokens(tok: Any) -> None:
    per_token = max_chars_per_token(tok)
    assert per_token is not None and per_token >= 4
    for text in hostile_texts(tok):
        tokens = len(tok(text)["input_ids"])
        assert tokens * per_token >= len(text), (text[:40], tokens, len(text))


def test_the_bound_scales_with_the_context(tok: Any) -> None:
    assert max_prompt_chars(tok, 4096) == 4096 * max_chars_per_token(tok)


@pytest.mark.parametrize(
    "normalizer", [normalizers.Strip(), normalizers.Replace(" ", ""), normalizers.BertNormalizer()]
)
def test_no_bound_when_the_normalizer_can_delete_text(tok: Any, normalizer: Any) -> None:
    other = copy.deepcopy(tok)
    other.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizer])
    assert max_chars_per_token(other) is None
