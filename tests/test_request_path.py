"""The one request path: every route hands a parsed request to `TokenizerManager.tokenize_request`,
which counts and budgets the media, prepares them, expands placeholders and checks the context
with the one rule (`TokenBudget`) that the scheduler also asks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from runtime.io_struct import (
    Finish,
    FinishKind,
    GetServerInfoReq,
    StrOutput,
    TokenizedGenerateReq,
    UnknownMessage,
)
from runtime.model_config import ModelConfig
from runtime.multimodal import Modality, item_tokens
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from runtime.token_budget import TokenBudget
from tokenizer_manager.front_end import FrontEnd, build_front_end
from tokenizer_manager.http.server import create_app
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.multimodal_inputs import (
    PreparedMedia,
    expand_placeholder_ids,
)
from tokenizer_manager.media.types import MediaRef, ProcessorSpec
from tokenizer_manager.metrics import ServingMetrics
from tokenizer_manager.protocol import APIError
from tokenizer_manager.tokenizer_manager import (
    INLINE_PROMPT_CHARS,
    GenerateInput,
    TokenizerManager,
    renders_quickly,
)

GRID = (1, 4, 6)  # 24 patches, 6 tokens with a 2x2 merge
IMAGE_URL = "data:image/png;base64,AAAA"


class RecordingMedia:
    """Stands in for the media processor: records the budget each request gets."""

    shm_dir = None  # items travel as tensors, not shared-memory files

    def __init__(self, patch_dim: int):
        self.patch_dim = patch_dim
        self.budgets: list[int | None] = []

    async def process(
        self, refs: list[MediaRef], budget: int | None, spec: object = None
    ) -> list[PreparedMedia]:
        self.budgets.append(budget)
        pixels = torch.zeros(int(np.prod(GRID)), self.patch_dim)
        return [
            PreparedMedia(ref.modality, pixels, GRID, digest=7 + i) for i, ref in enumerate(refs)
        ]

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("path") / "qwen2_vl")


def front_end(checkpoint: Path, kv_total: int | None = None) -> FrontEnd:
    """The served front end over a `RecordingMedia` instead of media workers."""

    def media(args: ServerArgs) -> Any:
        return RecordingMedia(ModelConfig.from_dir(args.model_path).vision.patch_dim)

    return build_front_end(ServerArgs(model_path=str(checkpoint)), kv_total=kv_total, media=media)


def manager(checkpoint: Path, kv_total: int | None = None) -> TokenizerManager:
    return front_end(checkpoint, kv_total).tm


def fixed(max_new_tokens: int | None) -> Any:
    """A sampling callback that records the room it was given."""
    seen: list[int] = []

    def make(room: int) -> SamplingParams:
        seen.append(room)
        return SamplingParams(max_new_tokens=max_new_tokens or room)

    make.seen = seen
    return make


def run(tm: TokenizerManager, inp: GenerateInput) -> TokenizedGenerateReq:
    return asyncio.run(tm.tokenize_request(inp))


def chat_input(max_tokens: int | None = 5) -> GenerateInput:
    content = [
        {"type": "image_url", "image_url": {"url": IMAGE_URL}},
        {"type": "text", "text": "hi"},
    ]
    return GenerateInput(
        "c", False, fixed(max_tokens), max_tokens, messages=[{"role": "user", "content": content}]
    )


def test_chat_and_text_prompts_expand_media_the_same_way(checkpoint: Path) -> None:
    tm = manager(checkpoint)
    chat = run(tm, chat_input())
    text = run(
        tm,
        GenerateInput(
            "t", False, fixed(5), 5, text="hi", media=[MediaRef(Modality.IMAGE, IMAGE_URL)]
        ),
    )
    for req in (chat, text):
        (item,) = req.mm_inputs.items
        start, end = item.offsets[0]
        assert end - start == item_tokens(GRID, tm.config.vision.spatial_merge_size) == 6
        assert req.input_ids[start - 1] == tm.config.vision_start_token_id
    assert text.input_ids[0] == tm.config.vision_start_token_id  # placeholders put in front


@pytest.mark.parametrize(
    "prompt",
    [
        "<|vision_start|><|image_pad|><|vision_end|>describe it",
        "a <|image_pad|> b<|video_pad|>c <|image_pad|>",
        " leading space<|image_pad|> trailing space ",
    ],
)
def test_spliced_placeholder_ids_equal_tokenizing_the_expanded_text(
    checkpoint: Path, prompt: str
) -> None:
    """The prompt is tokenized once; each placeholder id is repeated in place. Same ids as
    tokenizing the expanded text (the slow path, still used for timestamped videos)."""
    tm = manager(checkpoint)
    kinds = {"<|image_pad|>": Modality.IMAGE, "<|video_pad|>": Modality.VIDEO}
    grids = [(1, 4, 6), (2, 8, 4), (1, 2, 2)]
    media = [
        PreparedMedia(kinds[pad], torch.zeros(0), grid)
        for pad, grid in zip(tm.config.family.tokens.pad_re.findall(prompt), grids)
    ]
    spliced = expand_placeholder_ids(tm.encode(prompt), media, tm.config)
    assert spliced == tm.tokenize(prompt, media)
    assert len(spliced) > len(tm.encode(prompt)) + len(media)
    with pytest.raises(ValueError, match="count"):
        expand_placeholder_ids(tm.encode(prompt), media[:-1], tm.config)
    with pytest.raises(APIError):
        run(tm, GenerateInput("x", False, fixed(1), 1, text="typed <|image_pad|> by hand"))


def test_a_message_outside_the_channels_union_is_a_loud_error(checkpoint: Path) -> None:
    tm = manager(checkpoint)
    with pytest.raises(UnknownMessage, match="detokenizer -> tokenizer: unknown message"):
        tm._dispatch(GetServerInfoReq())  # a scheduler-bound request that came back


def test_media_budget_is_what_the_context_and_kv_pool_leave(checkpoint: Path) -> None:
    tm = manager(checkpoint, kv_total=200)
    inp = chat_input(max_tokens=30)
    req = run(tm, inp)
    text_tokens = len(req.input_ids) - 6
    assert tm.mm.budgets == [200 - text_tokens - 30]  # the KV pool, not only the context
    assert inp.sampling.seen == [200 - len(req.input_ids)]


def test_the_front_door_refuses_with_the_schedulers_rule(checkpoint: Path) -> None:
    tm = manager(checkpoint, kv_total=64)
    with pytest.raises(APIError) as info:
        run(tm, GenerateInput("x", False, fixed(60), 60, input_ids=list(range(10))))
    assert info.value.code == "context_length_exceeded"
    assert str(info.value) == TokenBudget(tm.context_length, 64).problem(10, 60)


def choices(n: int, max_new_tokens: int | None) -> Any:
    """`fixed` for a request with n choices."""
    inner = fixed(max_new_tokens)

    def make(room: int) -> SamplingParams:
        return dataclasses.replace(inner(room), n=n)

    make.seen = inner.seen
    return make


def test_choices_beyond_the_kv_pool_are_refused_naming_n(checkpoint: Path) -> None:
    """n x max_tokens past the KV pool, where one choice would fit, is a 400 naming n: when the
    outputs alone are too many, before the prompt is looked at (this one would be refused for
    its text); else with the prompt counted once (the choices share it). Without max_tokens the
    default cap is what leaves room for every choice."""
    tm = manager(checkpoint, kv_total=1000)
    bad_text = "typed <|image_pad|> by hand"
    with pytest.raises(APIError) as info:
        run(tm, GenerateInput("x", False, choices(64, 100), 100, 64, text=bad_text))
    assert (info.value.status, info.value.param, info.value.code) == (400, "n", "kv_pool_exceeded")
    ids = list(range(1, 101))
    with pytest.raises(APIError) as info:  # one choice alone is too long: the context rule's
        run(tm, GenerateInput("x", False, choices(64, 8000), 8000, 64, input_ids=ids))
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as info:  # 100 + 10 x 100 > 1000
        run(tm, GenerateInput("x", False, choices(10, 100), 100, 10, input_ids=ids))
    assert info.value.param == "n"
    assert str(info.value) == TokenBudget(tm.context_length, 1000).choices_problem(100, 100, 10)
    run(tm, GenerateInput("x", False, choices(9, 100), 100, 9, input_ids=ids))  # 100 + 900
    default = choices(9, None)
    assert run(tm, GenerateInput("x", False, default, None, 9, input_ids=ids))
    assert default.seen == [(1000 - 100) // 9]


@pytest.mark.parametrize(
    "inp,param",
    [
        (GenerateInput("x", False, fixed(1), 1, input_ids=[1, 10**7]), "prompt"),
        (
            GenerateInput(
                "x", False, fixed(1), 1, input_ids=[1], media=[MediaRef(Modality.IMAGE, IMAGE_URL)]
            ),
            "image_data",
        ),
    ],
)
def test_bad_token_prompts_are_client_errors(
    checkpoint: Path, inp: GenerateInput, param: str
) -> None:
    with pytest.raises(APIError) as info:
        run(manager(checkpoint), inp)
    assert (info.value.status, info.value.param) == (400, param)


def chat_with(text: str, image: bool = True) -> GenerateInput:
    content = [{"type": "image_url", "image_url": {"url": IMAGE_URL}}] if image else []
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
    return GenerateInput("c", False, fixed(5), 5, messages=messages)


def text_with(text: str, image: bool = False) -> GenerateInput:
    media = [MediaRef(Modality.IMAGE, IMAGE_URL)] if image else []
    return GenerateInput("t", False, fixed(5), 5, text=text, media=media)


def ids_with(ids: list[int]) -> GenerateInput:
    return GenerateInput("i", False, fixed(1), 1, input_ids=ids)


@pytest.mark.parametrize(
    "make,param",
    [
        (lambda c: chat_with("<|vision_start|>hello"), "messages"),
        (lambda c: chat_with("hi <|vision_end|>"), "messages"),
        (lambda c: chat_with("<|vision_start|>x<|vision_end|>", image=False), "messages"),
        (lambda c: chat_with("look: <|image_pad|>"), "messages"),
        (lambda c: chat_with("<|video_pad|>", image=False), "messages"),
        (lambda c: text_with("a <|vision_start|> b"), "prompt"),
        (lambda c: text_with("<|vision_end|><|vision_start|><|image_pad|>", image=True), "prompt"),
        (lambda c: ids_with([1, c.image_token_id]), "prompt"),
        (lambda c: ids_with([c.vision_start_token_id, 2]), "prompt"),
    ],
)
def test_processor_tokens_from_the_client_are_refused(
    checkpoint: Path, make: Any, param: str
) -> None:
    """Image/video pads and vision start/end are the media processor's: typed by a client in a
    message, a text prompt or token ids they are a 400 naming the field."""
    tm = manager(checkpoint)
    with pytest.raises(APIError) as info:
        run(tm, make(tm.config))
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, "invalid_special_token"), str(err)


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda: text_with("look: <|image_pad|>"), "prompt"),  # a placeholder and no image
        (lambda: text_with("<|image_pad|> and <|image_pad|>", image=True), "prompt"),
        (lambda: chat_with("look: <|image_pad|>", image=False), "messages"),
    ],
)
def test_placeholders_that_do_not_match_the_media_name_the_requests_field(
    checkpoint: Path, make: Any, param: str
) -> None:
    """A text prompt's placeholders without their media are a 400 naming `prompt` (the field a
    completions or /generate request has), a chat's naming `messages`."""
    with pytest.raises(APIError) as info:
        run(manager(checkpoint), make())
    assert (info.value.status, info.value.param) == (400, param), str(info.value)


def test_text_prompts_still_place_their_media_with_placeholders(checkpoint: Path) -> None:
    tm = manager(checkpoint)
    req = run(tm, text_with("first <|vision_start|><|image_pad|><|vision_end|> then", True))
    (item,) = req.mm_inputs.items
    assert req.input_ids[item.offsets[0][0] - 1] == tm.config.vision_start_token_id


def test_a_chat_template_error_is_a_400_with_its_message(checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "strict"
    shutil.copytree(checkpoint, folder)
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('tool messages need a preceding tool call') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tm = manager(folder)
    messages = [{"role": "tool", "content": "42"}]
    with pytest.raises(APIError) as info:
        run(tm, GenerateInput("c", False, fixed(5), 5, messages=messages))
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "tool messages need a preceding tool call" in str(info.value)


def test_every_route_goes_through_tokenize_request() -> None:
    """The HTTP layer only parses and formats: a manager offering nothing but the one entry (and
    the generator of outputs) serves chat, completions and /generate."""
    seen: list[GenerateInput] = []

    async def tokenize_request(inp: GenerateInput) -> TokenizedGenerateReq:
        seen.append(inp)
        return TokenizedGenerateReq(inp.rid, [1, 2], inp.sampling(100), None, inp.stream)

    async def generate(
        req: TokenizedGenerateReq, arrival: float | None = None, route: object = None
    ) -> Any:
        yield StrOutput(req.rid, "ok", [3], 2, 1, 0, Finish(FinishKind.STOP))

    args = ServerArgs(model_path="/models/demo")
    tm = SimpleNamespace(
        args=args, context_length=128, stalled=lambda: False, metrics=ServingMetrics(),
        tokenize_request=tokenize_request, generate=generate,
    )  # fmt: skip
    http = TestClient(create_app(tm))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert (
        http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        == "ok"
    )
    assert (
        http.post("/v1/completions", json={"prompt": [5, 6]}).json()["choices"][0]["text"] == "ok"
    )
    native = {"text": "hi", "image_data": IMAGE_URL, "sampling_params": {"max_new_tokens": 4}}
    assert http.post("/generate", json=native).json()["text"] == "ok"
    assert [bool(i.messages) for i in seen] == [True, False, False]
    assert seen[1].input_ids == [5, 6] and seen[2].media[0].url == IMAGE_URL
    assert [i.max_tokens for i in seen] == [3, None, 4]


@pytest.mark.parametrize("size", [(56, 56), (300, 200), (1000, 37), (29, 2000)])
def test_header_token_count_matches_the_image_processor(checkpoint: Path, size: tuple) -> None:
    """The budget read from an image's header counts what the image will take once processed."""
    from transformers import AutoImageProcessor

    width, height = size
    spec = ProcessorSpec.from_checkpoint(str(checkpoint), MediaLimits())
    out = AutoImageProcessor.from_pretrained(checkpoint)(
        images=[Image.new("RGB", size)], return_tensors="np"
    )
    grid = tuple(int(x) for x in out["image_grid_thw"][0])
    assert spec.image_cost(height, width)[0] == item_tokens(grid, spec.image.merge_size)


def test_short_chats_are_templated_and_tokenized_on_the_loop_with_the_same_ids(
    checkpoint: Path,
) -> None:
    """A short chat never hops to the CPU thread (two hops cost more than the work) and gets
    the ids the thread path gives; a long one, and one with tools, still go to the thread."""
    tm, reference = manager(checkpoint), manager(checkpoint)
    hops: list[str] = []

    async def recorded(fn: Any, *args: Any) -> Any:
        hops.append(fn.__name__)
        return fn(*args)

    tm.in_thread = recorded
    text = "describe the picture in a few words"
    assert run(tm, chat_with(text)).input_ids == run(reference, chat_with(text)).input_ids
    assert hops == []

    long_text = "word " * (INLINE_PROMPT_CHARS // 4)
    got = run(tm, chat_with(long_text))
    assert hops[:2] == ["render_chat", "encode"]
    assert got.input_ids == run(reference, chat_with(long_text)).input_ids

    hops.clear()
    run(tm, dataclasses.replace(chat_with("hi"), template_kwargs={"style": "terse"}))
    assert "render_chat" in hops


def test_which_chats_render_on_the_loop() -> None:
    user = {"role": "user", "content": "hello"}
    assert renders_quickly([user], {"add_generation_prompt": True})
    assert renders_quickly([{"role": "user", "content": [{"type": "text", "text": "x"}]}], None)
    assert not renders_quickly([{"role": "user", "content": "x" * (INLINE_PROMPT_CHARS + 1)}], None)
    many = [{"role": "user", "content": "x" * 1000}] * 5  # short messages, long chat
    assert not renders_quickly(many, None)
    assert not renders_quickly([user], {"tools": [{"type": "function"}]})
    assert not renders_quickly([user], {"documents": [{"text": "d"}]})
    calls = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    assert not renders_quickly([user, calls], None)
