"""A plain reference server: HF transformers `generate` behind the OpenAI chat-completions API.

    python scripts/hf_reference_server.py --model-path DIR --port 30001
    python scripts/bench_serving.py --base-url http://127.0.0.1:30001 ...

It serves one request at a time with nothing but transformers: the checkpoint's chat template,
its tokenizer and image processor, `generate` (greedy or sampled), and a streamer for SSE. Run it
next to a tessera server on the same checkpoint and load both with bench_serving.py to measure
what tessera adds or saves on your own hardware. Images come as data: URLs (what bench_serving
sends) or http(s) URLs; text-only chats work too. Not a production server: no batching, no
caches, no limits beyond one request at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.families import family_for  # noqa: E402
from runtime.multimodal import item_tokens  # noqa: E402
from tokenizer_manager.tokenizer_manager import load_chat_template  # noqa: E402

IMAGE_PAD = "<|image_pad|>"


class Reference:
    """The model, its processors and a lock: `generate` runs for one request at a time."""

    def __init__(self, model_path: str, device: str, dtype: torch.dtype):
        import transformers
        from transformers import AutoImageProcessor, AutoTokenizer

        config = json.loads((Path(model_path) / "config.json").read_text())
        model_class = getattr(transformers, config["architectures"][0])
        self.model = model_class.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.images = AutoImageProcessor.from_pretrained(model_path)
        self.template = load_chat_template(model_path, self.tokenizer)
        self.processor = family_processor(model_path, self.images, self.tokenizer, config)
        self.name = Path(model_path).name
        self.device, self.dtype = device, dtype
        # One request at a time, queued on the event loop. (Taken inside `stream`, a lock made
        # waiting requests block the executor's threads that advance the running one: with
        # more requests in flight than threads, every thread waited and nothing ran.)
        self.turn = asyncio.Lock()

    def inputs(self, messages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        images = [load_image(url) for url in image_urls(messages)]
        prompt = self.tokenizer.apply_chat_template(
            template_messages(messages), chat_template=self.template,
            tokenize=False, add_generation_prompt=True,
        )  # fmt: skip
        out: dict[str, torch.Tensor] = {}
        if self.processor is not None:  # the family's processor expands its own placeholders
            out = dict(self.processor(images=images or None, text=[prompt], return_tensors="pt"))
            return {k: v.to(self.device, self.dtype) if k == "pixel_values" else v.to(self.device)
                    for k, v in out.items()}  # fmt: skip
        if images:
            out = dict(self.images(images=images, return_tensors="pt"))
            prompt = expand_image_pads(prompt, out["image_grid_thw"], self.images.merge_size)
            out["pixel_values"] = out["pixel_values"].to(self.device, self.dtype)
            out["image_grid_thw"] = out["image_grid_thw"].to(self.device)
        ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"].to(self.device)
        image_id = self.model.config.image_token_id
        out |= {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        out["mm_token_type_ids"] = (ids == image_id).long()
        return out

    def stream(self, body: dict[str, Any], result: dict[str, Any]) -> Iterator[str]:
        """Text pieces as `generate` produces them (the caller holds `turn`). On return,
        `result` holds the usage and the finish reason."""
        from transformers import TextIteratorStreamer

        inputs = self.inputs(body["messages"])
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = generation_kwargs(body) | {"streamer": streamer}
        worker = threading.Thread(target=self.run, args=(inputs, kwargs, result))
        worker.start()
        try:
            yield from streamer
        finally:
            worker.join()  # also when the client left: the next request starts after it

    def run(self, inputs: dict[str, Any], kwargs: dict[str, Any], result: dict[str, Any]) -> None:
        with torch.inference_mode():
            out = self.model.generate(**inputs, **kwargs)
        prompt = int(inputs["input_ids"].shape[1])
        generated = int(out.shape[1]) - prompt
        result["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        }
        result["reason"] = "length" if generated >= kwargs["max_new_tokens"] else "stop"


def family_processor(model_path: str, images: Any, tokenizer: Any, config: dict) -> Any:
    """transformers' processor of a family that names one (`TinyCheckpoint.hf_processor_class`:
    the families whose placeholders the expansion below does not write; None for the others),
    built without a video processor: those need torchvision, and only images and text come here
    (its class check, which insists on one, is skipped for this construction)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    tiny = family_for(config).tiny
    name, keys = tiny.hf_processor_class, tiny.hf_processor_keys
    if name is None:
        return None
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *args: None
    try:
        return getattr(transformers, name)(
            image_processor=images, tokenizer=tokenizer, video_processor=None,
            chat_template=tokenizer.chat_template, **{k: config[k] for k in keys},
        )  # fmt: skip
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    return [
        part["image_url"]["url"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image_url"
    ]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI content parts -> the chat template's parts (image parts become placeholders)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = [
                {"type": "image"} if p.get("type") == "image_url" else p for p in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


def load_image(url: str) -> Any:
    from PIL import Image

    if url.startswith("data:"):
        data = base64.b64decode(url.split(",", 1)[1])
    else:
        import httpx

        data = httpx.get(url, timeout=30, follow_redirects=True).content
    return Image.open(io.BytesIO(data)).convert("RGB")


def expand_image_pads(prompt: str, grids: torch.Tensor, merge_size: int) -> str:
    """One placeholder per image becomes one per merged patch (what HF's processor does)."""
    pieces = prompt.split(IMAGE_PAD)
    out = [pieces[0]]
    for grid, rest in zip(grids.tolist(), pieces[1:]):
        out += [IMAGE_PAD * item_tokens(tuple(grid), merge_size), rest]
    return "".join(out)


def generation_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    temperature = body.get("temperature", 1.0)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 128
    kwargs: dict[str, Any] = {"max_new_tokens": int(max_tokens)}
    if temperature is None or temperature <= 1e-5:
        kwargs["do_sample"] = False
    else:
        top_p = body.get("top_p")
        kwargs |= {"do_sample": True, "temperature": float(temperature), "top_p": top_p or 1.0}
    if body.get("ignore_eos"):
        kwargs["min_new_tokens"] = kwargs["max_new_tokens"]
    return kwargs


# ---------------------------------------------------------------- HTTP


def create_app(ref: Reference) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": ref.name, "object": "model", "created": int(time.time()), "owned_by": "hf"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            return StreamingResponse(sse(ref, body, rid), media_type="text/event-stream")
        return JSONResponse(await completion(ref, body, rid))

    return app


async def pieces_of(
    ref: Reference, body: dict[str, Any], result: dict[str, Any]
) -> AsyncIterator[str]:
    """Run the blocking streamer in a thread, one piece at a time, one request at a time."""
    loop = asyncio.get_running_loop()
    async with ref.turn:
        pieces = ref.stream(body, result)
        done = object()
        try:
            while (piece := await loop.run_in_executor(None, next, pieces, done)) is not done:
                if piece:
                    yield piece
        finally:
            await loop.run_in_executor(None, pieces.close)


def envelope(ref: Reference, rid: str, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": ref.name,
            "choices": choices}  # fmt: skip


def event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


async def sse(ref: Reference, body: dict[str, Any], rid: str) -> AsyncIterator[bytes]:
    result: dict[str, Any] = {}

    def chunk(delta: dict[str, Any], reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        return event(envelope(ref, rid, "chat.completion.chunk", [choice]))

    yield chunk({"role": "assistant", "content": ""})
    async for piece in pieces_of(ref, body, result):
        yield chunk({"content": piece})
    yield chunk({}, result["reason"])
    if (body.get("stream_options") or {}).get("include_usage"):
        tail = envelope(ref, rid, "chat.completion.chunk", []) | {"usage": result["usage"]}
        yield event(tail)
    yield b"data: [DONE]\n\n"


async def completion(ref: Reference, body: dict[str, Any], rid: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    text = "".join([p async for p in pieces_of(ref, body, result)])
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": result["reason"]}
    return envelope(ref, rid, "chat.completion", [choice]) | {"usage": result["usage"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="HF checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30001)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if args.device == "cuda" else "float32"
    import uvicorn

    ref = Reference(args.model_path, args.device, getattr(torch, dtype))
    uvicorn.run(create_app(ref), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
