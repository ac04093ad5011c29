"""One way to build oracle cases for any family's tiny checkpoint, so a test that covers a serving
path takes the family as a parameter. A family whose oracle needs transformers' own processor
(its tiles or crops and expansion: InternVL's, Gemma 3's) says so in its test module,
tests/test_<family>.py, with two functions (`vlm_cases.family_test_hook`): `hf_processor(folder)`
and `family_case(processor, config, name, content, system, **settings)`; every other family's cases
come from the checkpoint's tokenizer, chat template and image processor (`vlm_cases.Checkpoint`).
Nothing here names a family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from vlm_cases import Case, Checkpoint, family_test_hook, load_hf

from runtime.model_config import ModelConfig
from runtime.multimodal import Modality
from tokenizer_manager.media.multimodal_inputs import PreparedMedia


class FamilyCases:
    """A checkpoint folder's case builder and HF model, whatever its family."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.config = ModelConfig.from_dir(self.folder)
        self.arch = self.config.arch
        self.takes_video = Modality.VIDEO in self.config.family.modalities
        self.own_case = family_test_hook(self.arch, "family_case")
        if self.own_case is not None:
            self.processor = family_test_hook(self.arch, "hf_processor")(self.folder)
            self.tokenizer = self.processor.tokenizer
        else:
            self.ckpt = Checkpoint(self.folder)
            self.tokenizer = self.ckpt.tokenizer

    def case(
        self, name: str, content: list[Any], system: str | None = None, **settings: Any
    ) -> Case:
        """content: strings and PIL images (and frame arrays, for a family that takes video);
        `settings`: the image processor's keyword arguments, as a request's
        mm_processor_kwargs would ask for them."""
        if self.own_case is not None:
            return self.own_case(self.processor, self.config, name, content, system, **settings)
        if settings:
            content = [self.image_media(p, settings) if isinstance(p, Image.Image) else p
                       for p in content]  # fmt: skip
        return self.ckpt.case(name, content, system)

    def image_media(self, image: Image.Image, settings: dict[str, Any]) -> PreparedMedia:
        out = self.ckpt.image_processor(images=[image], return_tensors="pt", **settings)
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return PreparedMedia(Modality.IMAGE, out["pixel_values"], grid)

    def model(self) -> Any:
        """transformers' model of the checkpoint, float32 (patch embedding as tessera's GEMM)."""
        return load_hf(self.folder)

    def text(self, tokens: list[int] | torch.Tensor) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
