"""What one model family declares: everything tessera needs to know about a checkpoint that the
shared code must not decide itself (design invariant 19).

A family is a plain value: data and pure functions, no torch modules. Its classes (vision tower,
decoder, composite model) are named as "module:Class" strings and resolved where the model is
built, so this floor (runtime/) never imports the floors above it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.families.tiny import TinyCheckpoint
from runtime.multimodal import Modality

Fields = dict[str, Any]
GridTHW = tuple[int, int, int]
MAX_ASPECT_RATIO = 200
IMAGE_ATTENTION_RULES = ("causal", "bidirectional_item")
POSITION_KINDS = ("mrope", "1d")
VIDEO_SAMPLINGS = ("uniform", "interval")


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served by tessera."""


def check_aspect_ratio(height: int, width: int) -> None:
    """The one aspect-ratio rule of images and video frames (ValueError beyond it)."""
    ratio = max(height, width) / max(1, min(height, width))
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"the aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio:g}")


@dataclass(frozen=True)
class MediaTokens:
    """A family's placeholder and boundary tokens: the strings its chat template writes (one pad
    per item, between start and end) and the config.json keys that hold their ids."""

    image_pad: str
    video_pad: str
    start: str
    end: str
    image_id_key: str = "image_token_id"
    video_id_key: str = "video_token_id"
    start_id_key: str = "vision_start_token_id"
    end_id_key: str = "vision_end_token_id"
    # True: the chat template writes start, pad, end and the processor repeats the pad; False:
    # the template writes the pad alone and the processor wraps the repeated pads in start/end.
    template_wraps: bool = True
    # A family whose videos have boundary tokens of their own (GLM-4.1V's `<|begin_of_video|>`),
    # with the frames inside them written with `frame_pad` ("": the start/end and video pad).
    video_start: str = ""
    video_end: str = ""
    video_frame_pad: str = ""
    video_start_id_key: str = "video_start_token_id"
    video_end_id_key: str = "video_end_token_id"
    # What the template writes for an image where that is neither the pad nor the wrapped run
    # (Gemma 3: the start token alone), and text the processor puts on both sides of an
    # expanded run (Gemma 3: "\n\n"). A family without videos has no video pad ("").
    template_mark: str = ""
    surround: str = ""

    def config_ids(self, ids: dict[str, int]) -> dict[str, int]:
        """The config.json id fields of these tokens, given the tokenizer's ids by string."""
        video = {}
        if self.video_start:
            video = {self.video_start_id_key: ids[self.video_start],
                     self.video_end_id_key: ids[self.video_end]}  # fmt: skip
        return {
            self.image_id_key: ids[self.image_pad],
            self.video_id_key: ids[self.video_pad],
            self.start_id_key: ids[self.start],
            self.end_id_key: ids[self.end],
            **video,
        }

    def pad(self, modality: Modality) -> str:
        return self.image_pad if modality == Modality.IMAGE else self.video_pad

    @property
    def frame_pad(self) -> str:
        """The pad a timestamped video's frames repeat."""
        return self.video_frame_pad or self.video_pad

    def bounds(self, modality: Modality) -> tuple[str, str]:
        """The start and end tokens the chat template writes around an item of `modality`."""
        if modality == Modality.VIDEO and self.video_start:
            return self.video_start, self.video_end
        return self.start, self.end

    def wrapped(self, modality: Modality) -> str:
        """One item's run as the chat template writes it: start, the pad, end (or the pad
        alone, where the processor places start and end: `template_wraps`)."""
        if self.template_mark and modality == Modality.IMAGE:
            return self.template_mark
        if not self.template_wraps:
            return self.pad(modality)
        start, end = self.bounds(modality)
        return start + self.pad(modality) + end

    def expanded(self, modality: Modality, count: int) -> str:
        """The prompt text of an item of `count` tokens: its pads, wrapped in start/end where
        the template does not write them."""
        pads = self.pad(modality) * count
        run = pads if self.template_wraps else self.start + pads + self.end
        return self.surround + run + self.surround

    @property
    def pads(self) -> tuple[str, ...]:
        return tuple(p for p in (self.image_pad, self.video_pad) if p)

    def marked(self, prompt: str) -> str:
        """`prompt` with each template mark replaced by the image pad (what
        `expand_placeholders` splits at)."""
        return prompt.replace(self.template_mark, self.image_pad) if self.template_mark else prompt

    @property
    def processor_tokens(self) -> tuple[str, ...]:
        """Tokens only the media processor places: one wrapped run per item, which it expands."""
        video = (self.video_start, self.video_end) if self.video_start else ()
        return self.start, self.end, *self.pads, *video

    @functools.cached_property
    def pad_re(self) -> re.Pattern[str]:
        """Splits a prompt at its pads, keeping them."""
        return re.compile("(" + "|".join(re.escape(p) for p in self.pads) + ")")

    @functools.cached_property
    def mark_re(self) -> re.Pattern[str]:
        """Finds where a text prompt marks its media: a pad, or a template mark."""
        marks = (*self.pads, self.template_mark) if self.template_mark else self.pads
        return re.compile("|".join(re.escape(p) for p in marks))


@dataclass(frozen=True)
class PositionKind:
    """How a family numbers positions. "mrope": a 3-D (temporal, height, width) grid per item,
    the sections (and whether they interleave) read from the config; with `time_scaled_video`
    a video's temporal ids are its seconds times the config's `tokens_per_second`. "1d": one
    id per token, counting up through media as through text (three equal rows, which the
    rotary reads as plain RoPE)."""

    kind: str = "mrope"
    time_scaled_video: bool = False

    def __post_init__(self) -> None:
        if self.kind not in POSITION_KINDS:
            raise ValueError(f"position kind {self.kind!r} is not one of {POSITION_KINDS}")


def seconds_before(seconds: float, frame: str) -> str:
    """Qwen3-VL's stamp: `<t seconds>` (one decimal) before the frame's run."""
    return f"<{seconds:.1f} seconds>" + frame


@dataclass(frozen=True)
class VideoStamp:
    """How a family with timestamped videos writes them (`Family.timestamped_video`).

    text(seconds, frame): the prompt text of one temporal patch, given its time and its run
        (start, `MediaTokens.frame_pad` per token, end).
    at: a temporal patch's time: "middle" (the mean of its first and last frame's) or "first"
        (its first frame's).
    keep_bounds: the chat template's start and end around the video stay and its pad alone
        becomes the frames (GLM-4.1V); otherwise the whole run does (Qwen3-VL)."""

    text: Callable[[float, str], str] = seconds_before
    at: str = "middle"
    keep_bounds: bool = False


def crop_kwargs(min_tiles: int, max_tiles: int) -> dict[str, Any]:
    """The image processor's settings that cut an image into min..max tiles (GotOcr2's)."""
    return {"crop_to_patches": True, "min_patches": min_tiles, "max_patches": max_tiles}


@dataclass(frozen=True)
class Tiling:
    """A family that cuts an image into fixed-size square tiles (the processor's tile side,
    min and max tile counts) instead of resizing it. Each tile is one frame of the item's grid,
    (tiles, side / patch, side / patch), encoded alone.

    count(height, width, side, min_tiles, max_tiles): how many tiles an image of that size
        takes, a thumbnail included (pure; what a header alone is charged).
    processor_kwargs(min_tiles, max_tiles): the image processor's arguments that tile it.
    keys: the `mm_processor_kwargs` a request may set (settings.py checks each and turns it into
        min_tiles / max_tiles): InternVL's tile counts, or Gemma 3's `do_pan_and_scan`.
    switched_on: max_tiles when a request turns cropping on with a switch (`do_pan_and_scan`:
        the whole image and up to that many crops less one); 0 where no key is a switch.
    crops_key: the key that caps the crops beside the whole image once the switch is on
        (`pan_and_scan_max_num_crops`, 1 up to switched_on - 1); "" where there is none.
    tile_text(run, tiles): the prompt text of an image of `tiles` tiles, each tile a placeholder
        run of its own (`run`: one tile's, surround included): Gemma 3's crops, each its own
        `<start_of_image>` run. None: one run holds every tile's tokens (InternVL)."""

    count: Callable[[int, int, int, int, int], int]
    processor_kwargs: Callable[[int, int], dict[str, Any]] = crop_kwargs
    keys: tuple[str, ...] = ("min_patches", "max_patches", "crop_to_patches")
    switched_on: int = 0
    crops_key: str = ""
    tile_text: Callable[[str, int], str] | None = None


@dataclass(frozen=True)
class Family:
    """One model family's entry in the registry (runtime/families/__init__.py).

    name: the family's key, also the config.json `model_type` it answers to.
    architectures: the config.json `architectures` names it serves.
    text_fields(text, top): `TextConfig` fields from the text part of config.json (`text_config`,
        or the whole config when flat) and the whole config.
    vision_fields(vision, text_hidden, top): `VisionConfig` fields from `vision_config` (and the
        whole config `top`, for a tower setting kept at its top level).
    tower_class / decoder_class / model_class: "module:Class" of its vision tower (floor 3,
        vision/), its decoder (floor 2, runtime/models/) and the composite that joins them
        (vision/vlm.py's by default), resolved where the model is built.
    checkpoint_name(name): a checkpoint tensor's name in the composite's layout (`visual.*` for
        the tower, the decoder's own names for the rest), from every layout the family's
        checkpoints are published in.
    tokens: its placeholder and boundary tokens (`MediaTokens`).
    positions: its position kind (`PositionKind`).
    image_attention: how media tokens attend: "causal" (like text), or "bidirectional_item"
        (every token of an item sees the whole item); a composite refuses a rule it lacks.
    resize(height, width, factor, min_pixels, max_pixels, num_frames=1, temporal_factor=1):
        an image's or video frame's target (height, width) for the processor settings (with
        `num_frames` and `temporal_factor` the bounds hold for a whole clip).
    item_tokens(grid_thw, merge): how many prompt tokens an item of that patch grid takes.
    tiny: its tiny random checkpoints (`TinyCheckpoint`: presets, config files, tensor names).
    clip_budget_video_processors: `video_processor_type`s of video_preprocessor_config.json
        whose settings (pixel bounds per clip, frame counts) are read from that file alone.
    timestamped_video: every temporal patch of a video is its own timestamped run of
        placeholders in the prompt, with its own position grid (t = 1), written as
        `video_stamp` says.
    video_sampling: how frames are picked from a video: "uniform" (Qwen's: evenly at the
        processor's fps, within min/max frames) or "interval" (one frame every 1 / fps seconds
        up to `max_duration`, then an even count: GLM-4.1V's video processor's rule).
    tiling: how the family tiles images (`Tiling`), or None where `resize` sizes them.
    modalities: the media kinds its checkpoints take; a request with another is refused.
    reasoning_parser: the `--reasoning-parser` rule `auto` picks for its checkpoints (None:
        none, the thinking stays in the content).
    refused_media_reason: why a media kind outside `modalities` is refused (told the client).
    """

    name: str
    architectures: tuple[str, ...]
    text_fields: Callable[[dict, dict], Fields]
    vision_fields: Callable[[dict, int, dict], Fields]
    tower_class: str
    decoder_class: str
    checkpoint_name: Callable[[str], str]
    tokens: MediaTokens
    resize: Callable[..., tuple[int, int]]
    item_tokens: Callable[[GridTHW, int], int]
    tiny: TinyCheckpoint
    clip_budget_video_processors: tuple[str, ...] = ()
    positions: PositionKind = PositionKind()
    image_attention: str = "causal"
    model_class: str = "vision.vlm:VisionLanguageModel"
    timestamped_video: bool = False
    video_stamp: VideoStamp = VideoStamp()
    video_sampling: str = "uniform"
    tiling: Tiling | None = None
    modalities: tuple[Modality, ...] = (Modality.IMAGE, Modality.VIDEO)
    reasoning_parser: str | None = None
    refused_media_reason: str = ""

    def __post_init__(self) -> None:
        if self.image_attention not in IMAGE_ATTENTION_RULES:
            rules = IMAGE_ATTENTION_RULES
            raise ValueError(f"image attention {self.image_attention!r} is not one of {rules}")
        if self.video_sampling not in VIDEO_SAMPLINGS:
            kinds = VIDEO_SAMPLINGS
            raise ValueError(f"video sampling {self.video_sampling!r} is not one of {kinds}")
