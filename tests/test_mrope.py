"""MRoPE positions against transformers' rope index, and the original rule where the two differ.

transformers 5.23 starts the text after a vision item at start + max(h, w) / merge, which ignores
the temporal extent; tessera starts it at the item's largest position + 1. Both agree whenever the
temporal ids stay below the merged height/width, so the comparisons use such grids, and the cases
where they differ are checked against hand-computed positions.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from runtime.mrope import (
    MRopeItem,
    compute_mrope_positions_from_items,
    decode_positions,
    find_mrope_items,
)
from runtime.multimodal import Modality

IMAGE, VIDEO, START, END = 500, 501, 502, 503
MERGE, TOKENS_PER_SECOND = 2, 2
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START)


def compute_mrope_positions(
    ids: list[int],
    *,
    spatial_merge_size: int,
    image_grid_thw: list | None = None,
    video_grid_thw: list | None = None,
    second_per_grid_ts: list[float] | None = None,
    tokens_per_second: float | None = None,
    **token_ids: int,
) -> tuple[torch.Tensor, int]:
    """Positions of a prompt that still holds placeholder ids: the items found as the front end
    finds them (`find_mrope_items`), then the span-based rule."""
    items = find_mrope_items(
        ids,
        spatial_merge_size=spatial_merge_size,
        image_grid_thw=[tuple(g) for g in image_grid_thw or []],
        video_grid_thw=[tuple(g) for g in video_grid_thw or []],
        second_per_grid_ts=second_per_grid_ts,
        **token_ids,
    )
    return compute_mrope_positions_from_items(
        len(ids), items, spatial_merge_size=spatial_merge_size, tokens_per_second=tokens_per_second
    )
TEXT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    bos_token_id=504,
    eos_token_id=505,
)
SPECIAL = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START)

Segment = int | tuple[str, tuple[int, int, int]]


@pytest.fixture(scope="module")
def qwen2_vl() -> Qwen2VLModel:
    vision = dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, spatial_merge_size=MERGE)
    return Qwen2VLModel(Qwen2VLConfig(text_config=TEXT, vision_config=vision, **SPECIAL)).eval()


@pytest.fixture(scope="module")
def qwen2_5_vl() -> Qwen2_5_VLModel:
    vision = dict(
        depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64,
        spatial_merge_size=MERGE, tokens_per_second=TOKENS_PER_SECOND, fullatt_block_indexes=[0],
    )  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, **SPECIAL)
    return Qwen2_5_VLModel(config).eval()


def build_prompt(segments: list[Segment], seed: int = 0) -> tuple[list[int], list[int]]:
    """Token ids and token types (0 text, 1 image, 2 video) for text lengths and vision items."""
    rng = random.Random(seed)
    ids: list[int] = []
    types: list[int] = []
    for segment in segments:
        if isinstance(segment, int):
            ids += [rng.randrange(0, 400) for _ in range(segment)]
            types += [0] * segment
            continue
        kind, (t, h, w) = segment
        count = t * h * w // MERGE**2
        ids += [START] + [IMAGE if kind == "image" else VIDEO] * count + [END]
        types += [0] + [1 if kind == "image" else 2] * count + [0]
    return ids, types


def grids(segments: list[Segment], kind: str) -> list[tuple[int, int, int]]:
    return [s[1] for s in segments if not isinstance(s, int) and s[0] == kind]


def reference(
    model: Qwen2VLModel | Qwen2_5_VLModel, segments: list[Segment], **extra: torch.Tensor
) -> tuple[torch.Tensor, int]:
    ids, types = build_prompt(segments)
    image, video = grids(segments, "image"), grids(segments, "video")
    positions, deltas = model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([types]),
        image_grid_thw=torch.tensor(image) if image else None,
        video_grid_thw=torch.tensor(video) if video else None,
        **extra,
    )
    return positions[:, 0], int(deltas.item())


def ours(segments: list[Segment], **extra: object) -> tuple[torch.Tensor, int]:
    ids, _ = build_prompt(segments)
    return compute_mrope_positions(
        ids,
        spatial_merge_size=MERGE,
        image_grid_thw=grids(segments, "image"),
        video_grid_thw=grids(segments, "video"),
        **IDS,
        **extra,
    )


AGREEING_QWEN2_VL = {
    "text_only": [17],
    "one_image": [5, ("image", (1, 8, 12)), 4],
    "two_images_different_grids": [3, ("image", (1, 4, 6)), ("image", (1, 10, 4)), 6],
    "image_text_image": [2, ("image", (1, 6, 6)), 9, ("image", (1, 4, 8)), 1],
    "image_first_and_last": [("image", (1, 4, 4)), 3, ("image", (1, 2, 6))],
    "video_t1": [4, ("video", (1, 6, 8)), 5],
    "video_t2": [4, ("video", (2, 8, 8)), 5],
    "video_and_image": [1, ("video", (2, 4, 6)), 2, ("image", (1, 8, 4)), 3],
}


@pytest.mark.parametrize("name", list(AGREEING_QWEN2_VL))
def test_qwen2_vl_matches_reference(qwen2_vl: Qwen2VLModel, name: str) -> None:
    segments = AGREEING_QWEN2_VL[name]
    expected, expected_delta = reference(qwen2_vl, segments)
    positions, delta = ours(segments)
    assert positions.dtype == torch.long and positions.shape == expected.shape
    assert torch.equal(positions, expected)
    assert delta == expected_delta


AGREEING_QWEN2_5_VL = {
    "video_one_second": ([3, ("video", (2, 8, 8)), 4], [1.0]),
    "video_half_second": ([3, ("video", (4, 16, 16)), 4], [0.5]),
    "image_and_video": ([2, ("image", (1, 6, 6)), 3, ("video", (2, 12, 8)), 2], [1.5]),
    "two_videos": ([1, ("video", (2, 8, 8)), 2, ("video", (2, 12, 12)), 2], [1.0, 2.5]),
}


@pytest.mark.parametrize("name", list(AGREEING_QWEN2_5_VL))
def test_qwen2_5_vl_video_matches_reference(qwen2_5_vl: Qwen2_5_VLModel, name: str) -> None:
    segments, seconds = AGREEING_QWEN2_5_VL[name]
    expected, expected_delta = reference(
        qwen2_5_vl, segments, second_per_grid_ts=torch.tensor(seconds)
    )
    positions, delta = ours(
        segments, second_per_grid_ts=seconds, tokens_per_second=TOKENS_PER_SECOND
    )
    assert torch.equal(positions, expected)
    assert delta == expected_delta


def test_qwen2_vl_video_longer_than_wide_uses_original_rule(qwen2_vl: Qwen2VLModel) -> None:
    # 2 text tokens + vision start, a 4x2x2 merged video, vision end + 1 text token.
    segments: list[Segment] = [2, ("video", (4, 4, 4)), 1]
    positions, delta = ours(segments)
    frame_t = [t for t in range(3, 7) for _ in range(4)]
    frame_h = [3, 3, 4, 4] * 4
    frame_w = [3, 4, 3, 4] * 4
    expected = torch.tensor(
        [
            [0, 1, 2, *frame_t, 7, 8],
            [0, 1, 2, *frame_h, 7, 8],
            [0, 1, 2, *frame_w, 7, 8],
        ]
    )
    assert torch.equal(positions, expected)
    assert delta == 9 - 21
    hf_positions, _ = reference(qwen2_vl, segments)
    assert hf_positions[0, -2].item() == 5  # the reference ignores the temporal extent here


def test_qwen2_5_vl_time_scaled_video_uses_original_rule() -> None:
    # 1 text token + vision start, a 3x2x2 merged video at 1 s per temporal patch, vision end.
    positions, delta = ours(
        [1, ("video", (3, 4, 4)), 0], second_per_grid_ts=[1.0], tokens_per_second=2
    )
    assert positions[0, 2:14].tolist() == [2] * 4 + [4] * 4 + [6] * 4
    assert positions[1, 2:6].tolist() == [2, 2, 3, 3]
    assert positions[2, 2:6].tolist() == [2, 3, 2, 3]
    assert positions[:, 14].tolist() == [7, 7, 7]
    assert delta == 8 - 15


def test_time_scaled_ids_truncate() -> None:
    item = MRopeItem(0, 4, Modality.VIDEO, (4, 2, 2), second_per_grid_t=0.7)
    positions, delta = compute_mrope_positions_from_items(
        4, [item], spatial_merge_size=2, tokens_per_second=2
    )
    assert positions[0].tolist() == [0, 1, 2, 4]  # 0, 1.4, 2.8, 4.2 truncated
    assert delta == 5 - 4


def items_of(segments: list[Segment]) -> list[MRopeItem]:
    """The MRopeItem of every vision segment, with spans counted from the segment lengths."""
    items, cursor = [], 0
    for segment in segments:
        if isinstance(segment, int):
            cursor += segment
            continue
        kind, (t, h, w) = segment
        start, cursor = cursor + 1, cursor + 2 + t * h * w // MERGE**2
        items.append(MRopeItem(start, cursor - 1, Modality(kind), (t, h, w)))
    return items


def test_items_on_padded_ids_match_token_ids() -> None:
    segments: list[Segment] = [3, ("image", (1, 4, 6)), 2, ("video", (2, 4, 4)), 4]
    ids, _ = build_prompt(segments)
    expected, expected_delta = ours(segments)
    items, padded = items_of(segments), list(ids)
    assert [(item.start, item.end) for item in items] == [(4, 10), (14, 22)]
    for index, item in enumerate(items):
        padded[item.start : item.end] = [1_000_000 + index * 7919] * (item.end - item.start)
    assert IMAGE not in padded and VIDEO not in padded
    positions, delta = compute_mrope_positions_from_items(
        len(padded), items, spatial_merge_size=MERGE
    )
    assert torch.equal(positions, expected) and delta == expected_delta


def test_items_covering_the_whole_prompt() -> None:
    item = MRopeItem(0, 6, Modality.IMAGE, (1, 4, 6))
    positions, delta = compute_mrope_positions_from_items(6, [item], spatial_merge_size=2)
    assert positions.tolist() == [[0] * 6, [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]]
    assert delta == 3 - 6
    empty, empty_delta = compute_mrope_positions_from_items(0, [], spatial_merge_size=2)
    assert empty.shape == (3, 0) and empty_delta == 0


def test_decode_positions_continue_after_prompt(qwen2_vl: Qwen2VLModel) -> None:
    segments: list[Segment] = [2, ("image", (1, 8, 4)), 3]
    positions, delta = ours(segments)
    length = positions.shape[1]
    first = decode_positions(length, delta)
    assert first.shape == (3, 1) and first[:, 0].tolist() == [int(positions.max()) + 1] * 3
    steps = decode_positions(torch.arange(length, length + 3), delta)
    assert steps.tolist() == [[length + delta + i for i in range(3)]] * 3
    _, hf_delta = reference(qwen2_vl, segments)
    assert first[0, 0].item() == length + hf_delta  # the reference's decode rule


def test_mismatched_grids_raise() -> None:
    ids, _ = build_prompt([2, ("image", (1, 4, 4)), 2])
    with pytest.raises(ValueError, match="grids given"):
        compute_mrope_positions(
            ids, spatial_merge_size=2, image_grid_thw=[(1, 4, 4), (1, 4, 4)], **IDS
        )
    with pytest.raises(ValueError, match="more image items"):
        compute_mrope_positions(ids, spatial_merge_size=2, **IDS)
    with pytest.raises(ValueError, match="shorter than grid"):
        compute_mrope_positions(ids, spatial_merge_size=2, image_grid_thw=[(1, 4, 8)], **IDS)


def test_bad_items_raise() -> None:
    image = MRopeItem(2, 6, Modality.IMAGE, (1, 4, 4))
    with pytest.raises(ValueError, match="needs 4"):
        compute_mrope_positions_from_items(
            10, [MRopeItem(2, 5, Modality.IMAGE, (1, 4, 4))], spatial_merge_size=2
        )
    with pytest.raises(ValueError, match="out of order"):
        compute_mrope_positions_from_items(10, [image, image], spatial_merge_size=2)
    with pytest.raises(ValueError, match="outside"):
        compute_mrope_positions_from_items(5, [image], spatial_merge_size=2)
    with pytest.raises(ValueError, match="merge size"):
        compute_mrope_positions_from_items(
            10, [MRopeItem(2, 5, Modality.IMAGE, (1, 3, 4))], spatial_merge_size=2
        )
