"""Shared test inputs: tiny checkpoints, chat prompts with images and videos, HF oracle runs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from video_reference import preprocess_video

from runtime.model_config import ModelConfig
from runtime.multimodal import Modality, MultimodalInputs
from tokenizer_manager.media.multimodal_inputs import (
    PreparedMedia,
    build_multimodal_inputs,
    expand_placeholders,
)
from tokenizer_manager.media.video_processor import checkpoint_video_config, frame_timestamps

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VIDEO_FPS = 2.0  # the frame rate test videos given as frame arrays are taken to have


def noise_image(size: tuple[int, int] = (56, 56), seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def gradient_image(size: tuple[int, int] = (84, 112)) -> Image.Image:
    h, w = size
    pixels = np.zeros((h, w, 3), np.uint8)
    pixels[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    pixels[..., 1] = np.linspace(0, 255, h, dtype=np.uint8)[:, None]
    return Image.fromarray(pixels)


def video_frames(n: int = 4, size: tuple[int, int] = (56, 84), seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (*size, 3))
    return np.stack([np.roll(base, 7 * i, axis=1) for i in range(n)]).astype(np.uint8)


@dataclass
class Case:
    """One prompt: the HF oracle's inputs and tessera's."""

    name: str
    hf_inputs: dict[str, torch.Tensor]
    input_ids: list[int]  # with pad values
    mm: MultimodalInputs | None
    hf_logits: torch.Tensor | None = None
    hf_tokens: list[int] = field(default_factory=list)


class Checkpoint:
    """A tiny checkpoint folder with its tokenizer, image processor and chat template."""

    def __init__(self, folder: Path):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.folder = folder
        self.config = ModelConfig.from_dir(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.image_processor = AutoImageProcessor.from_pretrained(folder)
        self.template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
        self.preprocessor = json.loads((folder / "preprocessor_config.json").read_text())

    def prepare(
        self, content: list[Any], system: str | None = None
    ) -> tuple[str, list[PreparedMedia]]:
        """content: strings, PIL images and [T,H,W,3] frame arrays, in order."""
        parts, media = [], []
        for piece in content:
            if isinstance(piece, str):
                parts.append({"type": "text", "text": piece})
            elif isinstance(piece, PreparedMedia):
                parts.append({"type": "image" if piece.modality == Modality.IMAGE else "video"})
                media.append(piece)
            elif isinstance(piece, Image.Image):
                parts.append({"type": "image"})
                media.append(self.image_media(piece))
            else:
                parts.append({"type": "video"})
                media.append(self.video_media(piece))
        messages = [{"role": "user", "content": parts}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        prompt = self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=True
        )
        return prompt, media

    def image_media(self, image: Image.Image) -> PreparedMedia:
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return PreparedMedia(Modality.IMAGE, out["pixel_values"], grid)

    def video_media(self, frames: np.ndarray) -> PreparedMedia:
        """Frames taken at VIDEO_FPS, preprocessed with the checkpoint's video settings (for
        Qwen2-VL / Qwen2.5-VL: preprocessor_config.json's pixel bounds, small test grids)."""
        cfg = checkpoint_video_config(self.folder)
        pixels, grid = preprocess_video(frames, **dataclasses.asdict(cfg))
        seconds = 1.0 if self.config.family.positions.time_scaled_video else None
        at = self.config.family.video_stamp.at
        times = frame_timestamps(range(len(frames)), VIDEO_FPS, cfg.temporal_patch_size, at)
        grid_thw = tuple(int(x) for x in grid[0])
        return PreparedMedia(Modality.VIDEO, pixels, grid_thw, seconds, frame_times=times)

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """HF's `mm_token_type_ids` (0 text, 1 image, 2 video): by pad token, or by the
        processor's own rule where the family's test module gives one (`token_types`: GLM-4.1V,
        whose frames repeat the image pad)."""
        own = family_test_hook(self.config.arch, "token_types")
        if own is not None:
            return own(input_ids, self.config)
        types = torch.zeros_like(input_ids)
        types[input_ids == self.config.image_token_id] = 1
        types[input_ids == self.config.video_token_id] = 2
        return types

    def case(self, name: str, content: list[Any], system: str | None = None) -> Case:
        prompt, media = self.prepare(content, system)
        ids = self.tokenizer(expand_placeholders(prompt, media, self.config))["input_ids"]
        our_ids, mm = build_multimodal_inputs(ids, media, self.config)
        return Case(name, self.hf_inputs(ids, media), our_ids, mm)

    def hf_inputs(self, ids: list[int], media: list[PreparedMedia]) -> dict[str, torch.Tensor]:
        input_ids = torch.tensor([ids])
        out: dict[str, torch.Tensor] = {"input_ids": input_ids}
        out["attention_mask"] = torch.ones_like(input_ids)
        types = self.token_types(input_ids)
        images = [m for m in media if m.modality == Modality.IMAGE]
        videos = [m for m in media if m.modality == Modality.VIDEO]
        if images:
            out["pixel_values"] = torch.cat([m.pixel_values for m in images])
            out["image_grid_thw"] = torch.tensor([m.grid_thw for m in images])
        if videos:
            out["pixel_values_videos"] = torch.cat([m.pixel_values for m in videos])
            out["video_grid_thw"] = torch.tensor([m.grid_thw for m in videos])
            if self.config.family.positions.time_scaled_video:
                out["second_per_grid_ts"] = torch.tensor([m.second_per_grid_t for m in videos])
        if media:
            out["mm_token_type_ids"] = types
        return out


def family_test_hook(family: str, name: str) -> Callable | None:
    """Function `name` of the family's test module (tests/test_<family>.py), where it defines
    one: how a family gives the shared test code what only it knows (its oracle's rules)."""
    import importlib
    import importlib.util

    module = f"test_{family}"
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), name, None)


def standard_cases(ckpt: Checkpoint) -> list[Case]:
    return [
        ckpt.case("text", ["Describe the cat."]),
        ckpt.case("image", [noise_image(), "What is in the picture?"]),
        ckpt.case("other_image", [gradient_image(), "What is in the picture?"]),
        ckpt.case("two_images", [gradient_image(), "and", noise_image(), "Compare them."]),
        ckpt.case("video", [video_frames(), "What happens?"]),
    ]


def run_hf(model: Any, case: Case, max_new_tokens: int = 16) -> None:
    """Fill the case's oracle prefill logits and greedy tokens. On one thread, as the test ranks
    run (dist_utils): MKL's float32 GEMM sums in another order on two threads than on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            case.hf_logits = model(**case.hf_inputs).logits[0].float()
            out = model.generate(**case.hf_inputs, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    case.hf_tokens = out[0, case.hf_inputs["input_ids"].shape[1] :].tolist()


def hf_generate(
    model: Any, case: Case, new_tokens: int, processors: list[Any] | None = None, **kw: Any
) -> Any:
    """HF greedy `generate` with these logits processors, on one thread as `run_hf`; returns
    transformers' output with the step logits (`sequences` holds the prompt too)."""
    from transformers import LogitsProcessorList

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model.generate(
                **case.hf_inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList(processors or []),
                return_dict_in_generate=True,
                output_logits=True,
                **kw,
            )
    finally:
        torch.set_num_threads(threads)


def assert_layouts_load_alike(folder: Path, tmp: Path, rename: Callable[[str], str]) -> None:
    """The checkpoint with every tensor renamed by `rename` (another published layout) builds
    the same tessera model, parameter for parameter."""
    import shutil

    from safetensors.torch import load_file, save_file

    from runtime.distributed import TPGroup
    from vision.vlm import build_model

    old = tmp / "old"
    shutil.copytree(folder, old)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({rename(k): v for k, v in weights.items()}, str(old / "model.safetensors"))
    new_model, old_model = (build_model(str(f), TPGroup(), dtype="float32", cpu_linear="aten")
                            for f in (folder, old))  # fmt: skip
    new_state, old_state = new_model.state_dict(), old_model.state_dict()
    assert new_state.keys() == old_state.keys()
    for key, value in new_state.items():
        assert torch.equal(value, old_state[key]), key


def load_hf(folder: Path, gemm_patch_embed: bool = True) -> Any:
    """transformers' model of the checkpoint; by default its patch embedding runs as tessera's
    (see `patch_embed_as_gemm`), `gemm_patch_embed=False` keeps transformers' Conv3d."""
    from runtime.tiny_checkpoint import hf_model_class

    arch = ModelConfig.from_dir(folder).arch
    model = hf_model_class(arch).from_pretrained(folder, dtype=torch.float32).eval()
    return patch_embed_as_gemm(model) if gemm_patch_embed else model


def patch_embed_as_gemm(model: Any) -> Any:
    """Run the vision patch embedding, a Conv3d whose stride is its kernel, as the one GEMM over
    flattened patches that it equals, the way tessera runs it (and transformers' own
    `fusion_config={"patch_embeddings": True}`, which cannot load these checkpoints' published
    names: in transformers 5.23 it leaves the projection unloaded). Every other module stays
    transformers' own. The two orders of summation differ by float32 rounding;
    `test_model_parity` bounds that gap against the Conv3d."""
    for module in model.modules():
        proj = getattr(module, "proj", None)
        if isinstance(proj, torch.nn.Conv3d):
            assert proj.stride == proj.kernel_size and proj.padding == (0, 0, 0)
            weight = proj.weight.reshape(proj.out_channels, -1)

            def forward(pixels: torch.Tensor, weight=weight, bias=proj.bias) -> torch.Tensor:
                rows = pixels.reshape(-1, weight.shape[1]).to(weight.dtype)
                return torch.nn.functional.linear(rows, weight, bias)

            module.forward = forward
    return model


# ----------------------------------------------------------------------------- family parity
# The checks every family's parity test makes on `parity_worker`'s results (tests/test_glm4v.py,
# tests/test_gemma3.py): `ranks` is (tp, per-rank results), keyed by (arch or preset, mode).


def run_parity_ranks(
    tp: int, arch: str, folder: Path, oracle: dict[str, Case], modes: tuple[str, ...],
    new_tokens: int, names: tuple[str, ...] | None = None,
) -> tuple[int, list]:  # fmt: skip
    """Every rank's results of the oracle's cases (those of `names` only, when given) in each
    encoder mode."""
    from dist_utils import run_on_ranks
    from parity_worker import parity_worker

    cases = [(c.name, c.input_ids, c.mm) for c in oracle.values() if not names or c.name in names]
    jobs = [(arch, str(folder), mode, cases) for mode in modes]
    return tp, run_on_ranks(parity_worker, tp, jobs, new_tokens, timeout=500)


def assert_logits_match(folder: Path, logits: torch.Tensor, case: Case) -> float:
    """Rounding only (another summation order: GEMM patch embedding, TP splits, chunks)."""
    from numerics import assert_within_rounding, model_terms

    terms = model_terms(ModelConfig.from_dir(folder), len(case.input_ids))
    return assert_within_rounding(logits, case.hf_logits, terms)


def check_prefill_logits(ranks: tuple[int, list], key: tuple, folder: Path, case: Case) -> None:
    """Whole, chunked and cut prefills of the case on rank 0 equal HF's logits."""
    result = ranks[1][0][key]
    for kind in ("logits", "chunked"):
        assert_logits_match(folder, result[case.name][kind], case)
    assert_logits_match(folder, result["_cut"][case.name], case)


def check_greedy_tokens(ranks: tuple[int, list], key: tuple, case: Case, new_tokens: int) -> None:
    """Every rank's greedy tokens equal HF's."""
    tp, results = ranks
    assert len(case.hf_tokens) == new_tokens
    for rank in range(tp):
        assert results[rank][key][case.name]["tokens"] == case.hf_tokens, f"rank {rank}"


def check_no_kv_left(ranks: tuple[int, list]) -> None:
    for per_rank in ranks[1]:
        assert all(r["_kv_free"] and r["_cut"]["_kv_free"] for r in per_rank.values())


def processor_case(
    processor: Any,
    config: ModelConfig,
    name: str,
    content: list[Any],
    media_of: Callable[[Any, Image.Image], PreparedMedia],
    hf_keys: tuple[str, ...] = ("pixel_values",),
    ids_path: bool = True,
    turns: list[tuple[str, list[Any]]] | None = None,
    settings: dict[str, Any] | None = None,
) -> Case:
    """A case whose HF inputs come from transformers' own processor (its chat template, its
    pixels, its placeholder expansion; `hf_keys` of its output go to the model with images);
    tessera's prompt ids, from its own text expansion (and, with `ids_path`, its splice of the
    ids, `expand_placeholder_ids`), must equal them. `media_of(processor, image)`: tessera's
    PreparedMedia of one image. `turns`: a conversation of (role, content) instead of one user
    message of `content` (its images in order). `settings`: the processor's keyword arguments
    (as a request's mm_processor_kwargs asks for them; `media_of` must apply them too)."""
    from tokenizer_manager.media.multimodal_inputs import expand_placeholder_ids

    turns = turns or [("user", content)]
    messages = [{"role": role, "content": [{"type": "text", "text": p} if isinstance(p, str)
                                           else {"type": "image"} for p in parts]}
                for role, parts in turns]  # fmt: skip
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [p for _, parts in turns for p in parts if isinstance(p, Image.Image)]
    hf = processor(images=images or None, text=[prompt], return_tensors="pt", **(settings or {}))
    media = [media_of(processor, image) for image in images]
    ids = processor.tokenizer(expand_placeholders(prompt, media, config))["input_ids"]
    assert ids == hf["input_ids"][0].tolist(), name
    if ids_path:
        spliced = expand_placeholder_ids(processor.tokenizer(prompt)["input_ids"], media, config)
        assert spliced == ids, name
    inputs = {"input_ids": hf["input_ids"], "attention_mask": hf["attention_mask"]}
    if images:
        inputs |= {key: hf[key] for key in hf_keys}
    our_ids, mm = build_multimodal_inputs(ids, media, config)
    return Case(name, inputs, our_ids, mm)


# tp 4 parity in one encoder mode (TP: the tower's heads split four ways) on one small image: the
# suite's time; every mode and case runs at tp 1 and 2
TP4_SUBSET = {4: (("tp",), ("image",))}


def parity_tests(  # noqa: ANN201
    arch: str, modes: tuple[str, ...], cases: tuple[str, ...], new_tokens: int,
    tps: tuple[int, ...] = (1, 2), subsets: dict[int, tuple[tuple[str, ...], tuple[str, ...]]]
    | None = None,
):  # fmt: skip
    """The parity tests of one family's test module (its `folder` and `oracle` fixtures): the
    `ranks` fixture at each TP size of `tps`, and tests of every mode and case; at a TP size of
    `subsets`, only its (modes, cases) are run, and the tests of the others deselected
    (conftest.py's `parity_subset` marker; the suite's time: e.g. tp 4 in one encoder mode on
    the cheapest case). A module takes them as
    `ranks, test_a, test_b, test_c = parity_tests(...)`."""
    import pytest

    subsets = subsets or {}
    plan = {tp: subsets.get(tp, (modes, cases)) for tp in tps}

    @pytest.fixture(scope="module", params=list(tps), ids=lambda tp: f"tp{tp}")
    def ranks(request: Any, folder: Path, oracle: dict) -> tuple[int, list]:
        tp = request.param
        tp_modes, names = plan[tp]
        return run_parity_ranks(tp, arch, folder, oracle, tp_modes, new_tokens, names)

    def keep(tp: int, params: dict[str, Any]) -> bool:
        tp_modes, names = plan[tp]
        return params["mode"] in tp_modes and params["case"] in names

    def each(fn: Callable) -> Callable:
        fn = pytest.mark.parametrize("case", cases)(fn)
        fn = pytest.mark.parametrize("mode", modes, ids=[f"vit_{m}" for m in modes])(fn)
        return pytest.mark.parity_subset.with_args(keep)(fn)

    @each
    def test_prefill_logits_match_hf(ranks, folder, oracle, mode: str, case: str) -> None:  # noqa: ANN001
        check_prefill_logits(ranks, (arch, mode), folder, oracle[case])

    @each
    def test_greedy_tokens_match_hf_on_every_rank(ranks, oracle, mode: str, case: str) -> None:  # noqa: ANN001
        check_greedy_tokens(ranks, (arch, mode), oracle[case], new_tokens)

    def test_no_kv_slot_is_left_behind(ranks) -> None:  # noqa: ANN001
        check_no_kv_left(ranks)

    return (ranks, test_prefill_logits_match_hf, test_greedy_tokens_match_hf_on_every_rank,
            test_no_kv_slot_is_left_behind)  # fmt: skip
