"""The checkpoint's generation_config.json (`--generation-config auto`, as vLLM reads it): its
sampling settings are the defaults of fields a request leaves unset, its EOS list stops
requests; transformers' `generate` with the same generation config is the oracle."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from test_server import Server, serve_then_check_teardown
from vlm_cases import load_hf

from runtime.model_config import GenerationDefaults, ModelConfig, read_generation_config
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint, save_generation_config

PROMPT = [11, 42, 97, 5, 300, 12, 64, 8]  # token ids: no chat template in the way
NEW_TOKENS = 12
# greedy through the checkpoint's own defaults: top_k 1 (and a temperature that is not 1)
SAMPLING = {"do_sample": True, "top_k": 1, "temperature": 0.7, "top_p": 0.9}


def hf_generate(folder: Path, **kw: object) -> list[int]:
    """HF generate with the folder's generation_config.json (as from_pretrained loads it)."""
    model = load_hf(folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, **kw)
    finally:
        torch.set_num_threads(threads)
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A checkpoint whose EOS list holds, besides <|im_end|>, the token the model greedily
    makes fourth (so a request must stop there), and HF's tokens for it."""
    folder = make_checkpoint(
        "qwen2_vl", tmp_path_factory.mktemp("gen") / "ckpt", generation=SAMPLING
    )
    free = hf_generate(folder, eos_token_id=None)
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    eos = [ModelConfig.from_dir(folder).eos_token_ids[0], stop]
    save_generation_config(folder, {**read_generation_config(folder), "eos_token_id": eos})
    expected = hf_generate(folder)
    assert expected[-1] == stop and len(expected) < NEW_TOKENS
    return folder, expected


@pytest.fixture(scope="module")
def server(
    checkpoint: tuple[Path, list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("gen_log") / "server.log"
    yield from serve_then_check_teardown(Server(str(checkpoint[0]), log))


def test_the_eos_list_joins_the_stop_set(checkpoint: tuple[Path, list[int]]) -> None:
    folder, expected = checkpoint
    assert ModelConfig.from_dir(folder).eos_token_ids[-1] == expected[-1]


def test_defaults_follow_vllms_reading(checkpoint: tuple[Path, list[int]]) -> None:
    folder = checkpoint[0]
    assert GenerationDefaults.load(folder).in_force() == {
        "top_k": 1,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    assert GenerationDefaults.load(folder, "vllm").in_force() == {}
    assert ServerArgs.from_cli(["--generation-config", "vllm"]).generation_config == "vllm"


def test_native_requests_take_the_checkpoint_defaults_and_eos(
    server: Server, checkpoint: tuple[Path, list[int]]
) -> None:
    """No temperature or top_k in the request: the checkpoint's top_k 1 makes it greedy, and it
    stops on the EOS list's second id, token-exact with HF generate."""
    expected = checkpoint[1]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    out = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    assert out["output_ids"] == expected
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_openai_requests_take_the_checkpoint_defaults_and_eos(
    server: Server, checkpoint: tuple[Path, list[int]]
) -> None:
    expected = checkpoint[1]
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(expected)


def test_a_request_value_beats_the_default(server: Server) -> None:
    """top_k 2 at temperature 2 from two seeds: not the greedy path every time."""
    outs = set()
    for seed in range(4):
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "top_k": 50,
                "temperature": 2.0, "seed": seed, "ignore_eos": True}}  # fmt: skip
        outs.add(
            tuple(httpx.post(server.url + "/generate", json=body, timeout=120).json()["output_ids"])
        )
    assert len(outs) > 1


def test_models_card_and_startup_log(server: Server) -> None:
    card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == "ckpt" and card["max_model_len"] > 0
    assert "sampling defaults in force: {'temperature': 0.7, 'top_p': 0.9, 'top_k': 1}" in (
        server.log.read_text()
    )
