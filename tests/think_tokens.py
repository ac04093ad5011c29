"""A tiny checkpoint whose vocabulary has Qwen3's `<think>` and `</think>` (plain added tokens,
not special, as Qwen3 ships them), for structured outputs behind a reasoning parser."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

THINK_TOKENS = ("<think>", "</think>")


def add_think_tokens(folder: Path) -> dict[str, int]:
    """Append the two tokens to the checkpoint's tokenizer in place; returns their ids."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in THINK_TOKENS}
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for text, i in ids.items():
        config["added_tokens_decoder"][str(i)] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": False,
        }
    config_path.write_text(json.dumps(config, indent=2))
    return ids
