"""Every serving path on every family beyond Qwen, end to end through the official openai client:
one tp 1 server per family (prefill chunks of CHUNK tokens, so every image prompt is prefilled in
several chunks, mixed steps on), reused by every check. Against transformers (the family's own
processor, chat template and generate): a resent image conversation reports its cached tokens,
a different image in the same place shares no KV, an image after other text hits the encoder
cache, requests prefilled while another decodes (mixed steps), `n` choices, top logprobs, a
json_schema response format, a repetition penalty, the processed-media cache, the family's
`mm_processor_kwargs` (honoured where its processor has the key, a 400 naming it otherwise:
Gemma 3's pan-and-scan crops among them), two images streamed and counted by /tokenize, and
the family's media tokens typed by a client refused (chat and completions).

A family joins with one line in FAMILIES and one in SETTINGS. The Qwen families' same paths are
covered by test_server, test_openai_sampling, test_structured_server and test_media_settings."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import family_server as fs
import jsonschema
import pytest
from family_cases import FamilyCases
from grammar_cases import SCHEMAS
from test_server import Server, client, idle_info, serve_then_check_teardown
from transformers.generation import logits_process as hf
from vlm_cases import gradient_image, hf_generate, noise_image, run_hf

from runtime.multimodal import Modality
from runtime.tiny_checkpoint import make_checkpoint

FAMILIES = ("internvl", "glm4v", "gemma3")
CHUNK = 8  # prefill chunk of the servers: every image prompt takes several
NEW = 12
LONG = 48  # HF's tokens of the decode that later requests are prefilled beside
QUESTION = "What is in the picture?"
TEXT = "Describe the cat and the dog and the cat again."
PENALTY = 1.8
IMAGE, OTHER = noise_image(), noise_image(seed=5)  # the same size: the same placeholder run
WIDE = noise_image((56, 392), seed=3)  # InternVL: 7 x 1 tiles and a thumbnail; GLM: 4 x 28
CONTENT = {
    "image": [IMAGE, QUESTION],
    "other_image": [OTHER, QUESTION],
    "look": ["Look closely.", IMAGE, QUESTION],
    "wide": [WIDE, QUESTION],
    "two_images": [gradient_image(), "and", OTHER, "Compare them."],
}
# Per family: (a request's mm_processor_kwargs its processor has, the processor's own keyword
# arguments for them, a key of another family's processor, the image the setting changes)
SETTINGS = {
    "internvl": ({"max_patches": 2}, {"max_patches": 2}, "max_pixels", WIDE),
    "glm4v": ({"max_pixels": 12544},
              {"size": {"shortest_edge": 3136, "longest_edge": 12544}}, "max_patches", WIDE),
    "gemma3": ({"do_pan_and_scan": True}, {"do_pan_and_scan": True}, "min_patches",
               noise_image((256, 600), seed=3)),  # crops need 256 px a side
}  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def cases(family: str, tmp_path_factory: pytest.TempPathFactory) -> FamilyCases:
    return FamilyCases(make_checkpoint(family, tmp_path_factory.mktemp("paths") / family))


@pytest.fixture(scope="module")
def oracle(cases: FamilyCases, family: str) -> dict[str, Any]:
    """HF's greedy text per chat, the text chat's step logits, its penalised text, and the
    prompt length of the wide image with the family's processor settings."""
    model = cases.model()
    out: dict[str, Any] = {"model": model}
    for name, content in CONTENT.items():
        case = cases.case(name, content)
        run_hf(model, case, NEW)
        out[name] = (cases.text(case.hf_tokens), len(case.input_ids))
        out[name + "_start"] = case.mm.items[0].offsets[0][0]
    image, text = cases.case("image", CONTENT["image"]), cases.case("text", [TEXT])
    steps = hf_generate(model, image, NEW)
    out["tokens"] = steps.sequences[0, len(image.input_ids) :].tolist()
    out["logits"] = [step[0].float() for step in steps.logits]
    long = hf_generate(model, text, LONG).sequences[0, len(text.input_ids) :]
    out["long"] = cases.text(long)
    penalised = hf_generate(model, text, NEW, [hf.RepetitionPenaltyLogitsProcessor(PENALTY)])
    out["penalised"] = cases.text(penalised.sequences[0, len(text.input_ids) :])
    out["plain"] = cases.text(long[:NEW])
    settings, image = SETTINGS[family][1], SETTINGS[family][3]
    out["wide_set"] = len(cases.case("wide_set", [image, QUESTION], **settings).input_ids)
    out["wide_unset"] = len(cases.case("wide_unset", [image, QUESTION]).input_ids)
    return out


@pytest.fixture(scope="module")
def server(cases: FamilyCases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--chunked-prefill-size", str(CHUNK))
    yield from fs.serve(cases.folder, tmp_path_factory, "paths_log", False, *flags)


@pytest.fixture(scope="module")
def server_tp4(cases: FamilyCases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The family at tp 4 with the DP encoder (four ranks on CI's two cores)."""
    log = tmp_path_factory.mktemp("tp4_log") / "server.log"
    yield from serve_then_check_teardown(Server(str(cases.folder), log, tp=4))


def chat(server: Server, family: str, content: list | str, **kw: Any) -> Any:
    kw = {"max_tokens": NEW, "temperature": 0, **kw}
    parts = content if isinstance(content, str) else fs.parts(content)
    messages = [{"role": "user", "content": parts}]
    return client(server).chat.completions.create(model=family, messages=messages, **kw)


def moved(server: Server, before: dict, *path: str) -> int:
    """How far a /server_info counter moved since `before` (read once the server is idle)."""
    after = idle_info(server)
    for key in path:
        after, before = after[key], before[key]
    return after - before


def test_oracle_outputs_differ(oracle: dict) -> None:
    texts = [oracle[name][0] for name in CONTENT]
    assert len(set(texts)) == len(texts) and oracle["penalised"] != oracle["plain"]


def test_a_resent_conversation_is_cached_and_equals_hf(server: Server, family: str,
                                                       oracle: dict) -> None:
    """The second send reports its prompt as cached (through the image), its image comes from
    the processed-media cache (no media worker), and both answers are HF's."""
    text, prompt_tokens = oracle["image"]
    first = chat(server, family, CONTENT["image"])
    before = idle_info(server)
    second = chat(server, family, CONTENT["image"])
    for out in (first, second):
        assert (out.choices[0].message.content, out.usage.prompt_tokens) == (text, prompt_tokens)
    assert prompt_tokens > 2 * CHUNK
    assert second.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 1
    assert moved(server, before, "media", "processed_cache", "hits") == 1


def test_another_image_in_the_same_place_shares_no_kv(server: Server, family: str,
                                                      oracle: dict) -> None:
    """Same prompt text, same placeholder run, other pixels: nothing past the image's start is
    reused, and the answer is HF's for that image."""
    chat(server, family, CONTENT["image"])
    out = chat(server, family, CONTENT["other_image"])
    text, prompt_tokens = oracle["other_image"]
    assert (out.choices[0].message.content, out.usage.prompt_tokens) == (text, prompt_tokens)
    assert out.usage.prompt_tokens_details.cached_tokens <= oracle["other_image_start"]


def test_an_image_after_other_text_hits_the_encoder_cache(server: Server, family: str,
                                                         oracle: dict) -> None:
    chat(server, family, CONTENT["image"])
    before = idle_info(server)
    out = chat(server, family, CONTENT["look"])
    assert out.choices[0].message.content == oracle["look"][0]
    assert moved(server, before, "encoder_cache", "items_encoded") == 0
    assert moved(server, before, "encoder_cache", "hits") >= 1


def test_prompts_prefilled_beside_a_running_decode_equal_hf(server: Server, family: str,
                                                            oracle: dict) -> None:
    """A long text decode streams; once its first token is out, image chats arrive and are
    prefilled chunk by chunk in the steps that carry it (mixed steps). The decode is far longer
    than they take; once they are answered the client hangs up on it."""
    before = idle_info(server)
    stream = chat(server, family, TEXT, max_tokens=2000, stream=True,
                  extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    streamed = [next(chunks).choices[0].delta.content or ""]
    answers: dict[str, str] = {}

    def ask(name: str) -> None:
        answers[name] = chat(server, family, CONTENT[name]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(name,)) for name in ("wide", "other_image")]
    for thread in threads:
        thread.start()
    for chunk in chunks:
        streamed.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        if not any(thread.is_alive() for thread in threads):
            break
    stream.close()
    for thread in threads:
        thread.join(timeout=300)
    assert answers == {name: oracle[name][0] for name in ("wide", "other_image")}
    text, hf_text = "".join(streamed), oracle["long"]
    assert len(text) > 0 and (text.startswith(hf_text) or hf_text.startswith(text))
    assert moved(server, before, "counters", "mixed_steps") > 0


def test_two_images_streamed_and_counted_equal_hf(server: Server, family: str,
                                                  oracle: dict) -> None:
    """Two different images in one message, streamed: HF's text and prompt length; /tokenize
    counts both images' tokens (their boundaries and the text the processor puts around them)."""
    stream = chat(server, family, CONTENT["two_images"], stream=True,
                  stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (text, chunks[-1].usage.prompt_tokens) == oracle["two_images"]
    body = {"messages": [{"role": "user", "content": fs.parts(CONTENT["two_images"])}]}
    counted = fs.post(server, "/tokenize", body)
    assert (counted.status_code, counted.json()["count"]) == (200, oracle["two_images"][1])


def test_n_choices_are_hfs_greedy_text(server: Server, family: str, oracle: dict) -> None:
    out = chat(server, family, CONTENT["image"], n=3)
    assert [c.message.content for c in out.choices] == [oracle["image"][0]] * 3
    assert out.usage.completion_tokens == 3 * NEW


def test_top_logprobs_are_hfs_log_softmax(server: Server, family: str, oracle: dict) -> None:
    out = chat(server, family, CONTENT["image"], logprobs=True, top_logprobs=3).choices[0]
    content = out.logprobs.content
    assert len(content) == NEW
    for entry, token, logits in zip(content, oracle["tokens"], oracle["logits"]):
        raw = logits.log_softmax(-1)
        assert abs(entry.logprob - raw[token].item()) < 2e-3
        values, _ = raw.topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=2e-3)


def test_a_json_schema_response_follows_it(server: Server, family: str) -> None:
    schema = SCHEMAS[0]
    form = {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}
    out = chat(server, family, [IMAGE, "Fill in the form."], max_tokens=200,
               response_format=form).choices[0]  # fmt: skip
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.message.content), schema)


def test_a_repetition_penalty_is_hfs_logits_processor(server: Server, family: str,
                                                      oracle: dict) -> None:
    out = chat(server, family, TEXT, extra_body={"repetition_penalty": PENALTY})
    assert out.choices[0].message.content == oracle["penalised"]


def test_the_processors_own_setting_is_honoured_and_counted(server: Server, family: str,
                                                            oracle: dict) -> None:
    """/tokenize (the front end's count, what the token budget charges) with the family's
    setting equals its processor's prompt length with it, and differs from the default's."""
    request = SETTINGS[family][0]
    body = {"messages": [{"role": "user", "content": fs.parts([SETTINGS[family][3], QUESTION])}]}
    counted = fs.post(server, "/tokenize", {**body, "mm_processor_kwargs": request})
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == oracle["wide_set"] != oracle["wide_unset"]
    out = fs.post(server, "/v1/chat/completions", {**body, "model": family, "max_tokens": 2,
                                                   "mm_processor_kwargs": request})  # fmt: skip
    assert out.json()["usage"]["prompt_tokens"] == oracle["wide_set"]


@pytest.mark.parametrize("key", ["other", "unknown_key"])
def test_a_key_the_processor_lacks_is_a_400_naming_it(server: Server, family: str,
                                                      key: str) -> None:
    name = SETTINGS[family][2] if key == "other" else key
    body = {"model": family, "messages": [{"role": "user", "content": fs.parts([IMAGE, "x"])}],
            "mm_processor_kwargs": {name: 2}}  # fmt: skip
    out = fs.post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    assert out.json()["error"]["param"] == f"mm_processor_kwargs.{name}"


def test_nothing_is_held_after_the_paths(server: Server, family: str) -> None:
    body = {"model": family, "max_tokens": 4,
            "messages": [{"role": "user", "content": fs.parts(CONTENT["wide"])}]}  # fmt: skip
    fs.assert_nothing_held(server, body)


def test_media_tokens_typed_in_a_chat_are_refused(server: Server, family: str,
                                                  cases: FamilyCases) -> None:
    """Each boundary and placeholder token of the family, typed in a chat message's text beside
    an image, is a 400 naming messages (and saying the token); a video, to a family that takes
    images only, a 400 naming video_url."""
    family_of = cases.config.family
    for token in family_of.tokens.processor_tokens:
        fs.assert_typed_token_refused(server, family, token)
    if Modality.VIDEO not in family_of.modalities:
        fs.assert_video_refused(server, family)


def test_media_tokens_typed_in_a_prompt_are_refused(server: Server, family: str,
                                                    cases: FamilyCases) -> None:
    """The family's boundary and placeholder tokens, typed in a completions prompt or given as
    token ids, are the media processor's alone: a 400 naming the prompt (chat messages:
    family_server.assert_typed_token_refused)."""
    config = cases.config
    prompts = [f"a {token} b" for token in config.family.tokens.processor_tokens]
    prompts += [[1, config.image_token_id, 2], [config.vision_start_token_id, 5]]
    for prompt in prompts:
        out = fs.post(server, "/v1/completions", {"model": family, "prompt": prompt,
                                                  "max_tokens": 2})  # fmt: skip
        assert out.status_code == 400, prompt
        assert out.json()["error"]["param"] == "prompt", prompt


def test_at_tp4_with_the_dp_encoder_chats_equal_hf(server_tp4: Server, family: str,
                                                   cases: FamilyCases, oracle: dict) -> None:
    """Four ranks, the tower in DP mode: a text chat, one image sent twice (the second from the
    prefix cache) and two images streamed answer HF's text and prompt length."""
    out = chat(server_tp4, family, TEXT)
    prompt = len(cases.case("text", [TEXT]).input_ids)
    assert (out.choices[0].message.content, out.usage.prompt_tokens) == (oracle["plain"], prompt)
    text, prompt_tokens = oracle["image"]
    first, second = (chat(server_tp4, family, CONTENT["image"]) for _ in range(2))
    for out in (first, second):
        assert (out.choices[0].message.content, out.usage.prompt_tokens) == (text, prompt_tokens)
    assert second.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 1
    stream = chat(server_tp4, family, CONTENT["two_images"], stream=True,
                  stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed, chunks[-1].usage.prompt_tokens) == oracle["two_images"]
