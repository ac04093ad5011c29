"""One way to build oracle cases for any family's tiny checkpoint, so a test that covers a serving
path takes the family as a parameter: InternVL's cases come from transformers' own
InternVLProcessor (its tiles and expansion), Gemma 3's from its Gemma3Processor (bidirectional
images: `token_type_ids`), every other family's from the checkpoint's tokenizer, chat template
and image processor (`vlm_cases.Checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image
from vlm_cases import Case, Checkpoint, load_hf

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
        if self.arch == "internvl":
            from test_internvl import hf_processor

            self.processor = hf_processor(self.folder)
            self.tokenizer = self.processor.tokenizer
        elif self.arch == "gemma3":
            from test_gemma3 import hf_processor as gemma_processor

            self.processor = gemma_processor(self.folder)
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
        if self.arch == "internvl":
            from test_internvl import make_case

            return make_case(self.processor, self.config, name, content, system, **settings)
        if self.arch == "gemma3":
            from test_gemma3 import make_case as gemma_case

            if system is not None or settings:
                raise ValueError("Gemma 3 cases take one user message and no image settings")
            return gemma_case(self.processor, self.config, name, content)
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
