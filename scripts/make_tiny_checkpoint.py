"""Write a random checkpoint folder of any registered family (runtime/tiny_checkpoint.py).

    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --out /tmp/tiny-qwen2-vl
    python scripts/make_tiny_checkpoint.py --arch qwen2_5_vl --out /data/q25-7b --preset 7b
    python scripts/make_tiny_checkpoint.py --arch qwen3_vl --out /tmp/tiny-qwen3-vl
    python scripts/make_tiny_checkpoint.py --arch qwen2_vl --out /tmp/vit-heavy --preset vit-heavy
    python scripts/make_tiny_checkpoint.py --arch qwen2_5_vl --out /tmp/vit-hd64 --preset vit-hd64
    python scripts/make_tiny_checkpoint.py --arch internvl --out /tmp/internvl-hd64 --preset hd64
    python scripts/make_tiny_checkpoint.py --arch internvl --out /tmp/ivl-heavy --preset vit-heavy
    python scripts/make_tiny_checkpoint.py --arch glm4v --out /tmp/glm-heavy --preset vit-heavy
    python scripts/make_tiny_checkpoint.py --arch gemma3 --out /tmp/g3-heavy --preset vit-heavy

Encoder-heavy presets, one per family (its tower shaped like the published one, scaled to a
2-core CPU, in front of a tiny decoder): qwen2_vl vit-heavy, qwen2_5_vl vit-hd64, internvl, glm4v
and gemma3 vit-heavy. A new family adds its own to its `TinyCheckpoint.presets`.
"""

from __future__ import annotations

from runtime.tiny_checkpoint import main

if __name__ == "__main__":
    print(main())
