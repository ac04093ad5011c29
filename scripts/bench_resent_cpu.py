"""Main-process CPU of a resent image turn against a text turn, one request at a time.

    python scripts/bench_resent_cpu.py --model-path /tmp/vit-heavy --requests 100 --reps 6

Starts one tessera server (`launch.py --device cpu`). A chat with 2 new PNG data: URLs
(`--image-size`, 1.6 MB of body at 448) is sent once (a miss), then the same body
`--requests` times in a row (processed-item cache hits: the media front end does no decode),
alternating with as many text chats, `--reps` times; /proc gives the main process's CPU
(HTTP, parse, template, tokenizer, media front end, sending) per request. A resent image's cost
in the main process is (image request - text request) / 2. Then `--misses` chats with new
images give a miss's front-end CPU per image: the media workers' plus the main process's beyond
half a text request. `hit_vs_miss` is issue 30's ratio (target under 5%). /proc counts 10 ms
ticks: 100 requests a rep resolve 0.1 ms per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import httpx
import numpy as np
from bench_multiturn import image_url, server_pids
from bench_vs_reference import make_server, proc_stat


def body(model: str, content: object) -> bytes:
    message = {"role": "user", "content": content}
    return json.dumps({"model": model, "messages": [message], "max_tokens": 1,
                       "temperature": 0}).encode()


def image_body(model: str, urls: list[str]) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return body(model, [*parts, {"type": "text", "text": "Look at these two images."}])


def send(client: httpx.Client, payload: bytes) -> None:
    resp = client.post("/v1/chat/completions", content=payload,
                       headers={"content-type": "application/json"})
    resp.raise_for_status()


def cpu_ms_per_request(client: httpx.Client, pid: int, payload: bytes, n: int) -> float:
    before = proc_stat(pid).cpu_s
    for _ in range(n):
        send(client, payload)
    return (proc_stat(pid).cpu_s - before) / n * 1e3


def run(args: argparse.Namespace, client: httpx.Client, pids: tuple[int, list[int]],
        model: str) -> dict:
    main, workers = pids
    rng = np.random.default_rng(args.seed)
    image = image_body(model, [image_url(rng, args.image_size) for _ in range(2)])
    text = body(model, "picture " * 400 + "Look at these two images.")
    for payload in (image, text, image, text):  # the miss, then warm
        send(client, payload)
    reps: dict[str, list[float]] = {"image": [], "text": []}
    for _ in range(args.reps):
        for name, payload in (("image", image), ("text", text)):
            reps[name].append(cpu_ms_per_request(client, main, payload, args.requests))
    before = {p: proc_stat(p).cpu_s for p in [main, *workers]}
    for _ in range(args.misses):
        send(client, image_body(model, [image_url(rng, args.image_size) for _ in range(2)]))
    spent = [(proc_stat(p).cpu_s - before[p]) / (2 * args.misses) * 1e3 for p in before]
    hit = (statistics.median(reps["image"]) - statistics.median(reps["text"])) / 2
    miss = spent[0] - statistics.median(reps["text"]) / 2 + sum(spent[1:])
    return {"image_ms_per_request": reps["image"], "text_ms_per_request": reps["text"],
            "hit_ms_per_image": hit, "miss_main_ms_per_image": spent[0],
            "miss_workers_ms_per_image": sum(spent[1:]), "miss_ms_per_image": miss,
            "hit_vs_miss": hit / miss, "body_mb": len(image) / 1e6}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--misses", type=int, default=20)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=Path("bench_resent_cpu_logs"))
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    server = make_server("tessera=--tp 1", args.model_path, args.log_dir)
    server.start()
    try:
        server.wait_ready(300)
        client = httpx.Client(base_url=server.url, timeout=120)
        model = client.get("/v1/models").json()["data"][0]["id"]
        report = run(args, client, server_pids(server), model)
    finally:
        server.stop()
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
