"""scripts/hf_reference_server.py: plain transformers behind the chat API gives HF's own greedy
text for image chats (inputs built independently by the test helpers), streamed or not."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from hf_reference_server import Reference, create_app
from test_internvl import hf_processor, make_case
from test_server import png_url
from transformers import AutoTokenizer
from vlm_cases import Case, Checkpoint, gradient_image, load_hf, noise_image, run_hf

from runtime.model_config import ModelConfig
from runtime.tiny_checkpoint import make_checkpoint

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("ref") / "qwen2_vl")


@pytest.fixture(scope="module")
def client(folder: Path) -> TestClient:
    import torch

    return TestClient(create_app(Reference(str(folder), "cpu", torch.float32)))


def oracle_text(folder: Path, parts: list) -> str:
    ckpt = Checkpoint(folder)
    case = ckpt.case("c", parts)
    run_hf(load_hf(folder), case, NEW_TOKENS)
    return ckpt.tokenizer.decode(case.hf_tokens, skip_special_tokens=True)


def body(images: list, text: str, **extra: object) -> dict:
    content = [{"type": "image_url", "image_url": {"url": png_url(i)}} for i in images]
    content.append({"type": "text", "text": text})
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        **extra,
    }


@pytest.mark.parametrize("images", [[noise_image()], [gradient_image(), noise_image()]])
def test_greedy_text_equals_hf(client: TestClient, folder: Path, images: list) -> None:
    expected = oracle_text(folder, [*images, "Describe."])
    out = client.post("/v1/chat/completions", json=body(images, "Describe.")).json()
    assert out["choices"][0]["message"]["content"] == expected
    assert out["usage"]["completion_tokens"] <= NEW_TOKENS


def test_stream_equals_full_response(client: TestClient) -> None:
    request = body([noise_image()], "Describe.", ignore_eos=True)
    full = client.post("/v1/chat/completions", json=request).json()
    streamed = request | {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=streamed) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == full["usage"]
    assert full["usage"]["completion_tokens"] == NEW_TOKENS
    assert full["choices"][0]["finish_reason"] == "length"
    assert client.get("/v1/models").json()["data"][0]["id"] == "qwen2_vl"


def test_more_requests_in_flight_than_executor_threads(folder: Path) -> None:
    """Six streamed requests at once on an executor of two threads all finish: waiting
    requests queue on the event loop and never hold the threads the running one needs."""
    import torch

    app = create_app(Reference(str(folder), "cpu", torch.float32))
    request = body([noise_image()], "Describe.", ignore_eos=True, stream=True)

    async def one(client: httpx.AsyncClient) -> str:
        async with client.stream("POST", "/v1/chat/completions", json=request) as resp:
            return [line async for line in resp.aiter_lines() if line.startswith("data: ")][-1]

    async def run() -> list[str]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ref") as client:
            return await asyncio.wait_for(asyncio.gather(*[one(client) for _ in range(6)]), 120)

    assert asyncio.run(run()) == ["data: [DONE]"] * 6


def family_case(folder: Path, arch: str, parts: list) -> Case:
    """HF's inputs for an InternVL or GLM-4.1V chat, built by the test helpers of each family
    (InternVL: its own InternVLProcessor's tiles, checked against tessera's expansion)."""
    if arch == "internvl":
        return make_case(hf_processor(folder), ModelConfig.from_dir(folder), "c", parts)
    return Checkpoint(folder).case("c", parts)


@pytest.mark.parametrize("arch", ["internvl", "glm4v"])
def test_other_families_greedy_text_equals_hf(arch: str, tmp_path: Path) -> None:
    """The family's own processor writes its image tokens (InternVL's tiles between <img> and
    </img>, GLM-4.1V's merged patches): prompt tokens and greedy text are transformers'."""
    import torch

    folder = make_checkpoint(arch, tmp_path / arch)
    images = [noise_image(), gradient_image()]
    case = family_case(folder, arch, [*images, "Describe."])
    run_hf(load_hf(folder, gemm_patch_embed=False), case, NEW_TOKENS)
    client = TestClient(create_app(Reference(str(folder), "cpu", torch.float32)))
    out = client.post("/v1/chat/completions", json=body(images, "Describe.")).json()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(
        case.hf_tokens, skip_special_tokens=True
    )
    assert out["usage"]["prompt_tokens"] == case.hf_inputs["input_ids"].shape[1]
