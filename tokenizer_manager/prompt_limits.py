"""A prompt refused by its length in characters, before it is tokenized, when it cannot fit the
context: the bound never refuses a prompt that fits.

For a byte-level BPE (every Qwen tokenizer) each token stands for the bytes of its vocabulary
string, one character per byte, so a token covers at most `longest` characters of normalized
text, the longest vocabulary entry (added tokens such as `<|im_start|>` included: they match
their own text). Unicode composition (NFC, NFKC) can merge at most 4 characters into one (a
canonical decomposition is at most 4 long), so a prompt of `c` characters has at least
`c / (4 * longest)` tokens. Tokenizers that are not byte-level (an unknown word may be one
token) or whose normalizer can delete text get no bound.
"""

from __future__ import annotations

import json
from typing import Any

COMPOSING = {"NFC": 4, "NFKC": 4}  # characters one composed character can stand for
NOT_SHRINKING = {"NFD", "NFKD", "Prepend"}  # normalizers that never make text shorter


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most prompt characters one token can cover, or None when it is unbounded."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    return shrink * max(len(token) for token in tokenizer.get_vocab())


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many characters the normalizer may turn into one (None: it may delete text)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            step = _shrink(part)
            if step is None:
                return None
            factor *= step
        return factor
    if kind in COMPOSING:
        return COMPOSING[kind]
    return 1 if kind in NOT_SHRINKING else None


def max_prompt_chars(tokenizer: Any, context_length: int) -> int | None:
    """Characters beyond which a prompt cannot fit `context_length` tokens (None: no bound)."""
    per_token = max_chars_per_token(tokenizer)
    return None if per_token is None else context_length * per_token
