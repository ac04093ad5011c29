"""`bench_vit_dp_vs_tp.py --served`: the vision encoder's modes as a user meets them, each mode a
fresh server start, one client sending issue 54's stream.

One client alternates a request with one large image (896x896) and one with six small ones
(224x224), max_tokens 1, every image new (no cache hit), after a warm-up pair. Per mode and
round: requests/s over the first 12 and over all --requests (32) requests, from the client's
latencies. Each round starts every mode once, in a rotated order (tp dp auto, dp auto tp, ...),
so load on a shared machine hits them alike; auto's ratios to the better static mode (the one
with the higher median over the rounds) are taken per round and their medians reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_serving import image_data_url, make_image
from bench_vs_vllm import rotated, running, tessera_server

MODES = ("tp", "dp", "auto")
LARGE, SMALL = (896, 896), (224, 224)
FIRST = 12
READY_S = 1800.0  # a loaded 2-core host calibrates auto mode slowly


def stream(count: int, seed: int) -> list[list[str]]:
    """The requests' images as data URLs: large and six small in turn, every image new."""
    rng = np.random.default_rng(seed)
    sizes = [[LARGE] if i % 2 == 0 else [SMALL] * 6 for i in range(count)]
    return [[image_data_url(make_image(rng, size), "png") for size in item] for item in sizes]


def payload(model: str, urls: list[str]) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": "What is shown?"})
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 1, "temperature": 0.0}


def run_mode(mode: str, args: argparse.Namespace, requests: list[list[str]],
             log_dir: Path, round_: int) -> dict[str, Any]:
    """One fresh server in `mode`: the warm-up pair, then the timed requests one at a time."""
    flags = ["--tp", str(args.tp), "--mm-encoder-mode", mode, *args.server_flags.split()]
    server = tessera_server(f"{mode}-{round_}", flags, args.model_path, log_dir)
    started = time.monotonic()
    with running(server, READY_S), httpx.Client(base_url=server.url, timeout=600,
                                                 trust_env=False) as client:
        ready_s = time.monotonic() - started
        model = client.get("/v1/models").json()["data"][0]["id"]
        latencies = []
        for i, urls in enumerate(requests):
            start = time.perf_counter()
            reply = client.post("/v1/chat/completions", json=payload(model, urls))
            reply.raise_for_status()
            if i >= 2:  # after the warm-up pair
                latencies.append(time.perf_counter() - start)
        plans = client.get("/server_info").json().get("encoder_plans", {})
    return {"mode": mode, "round": round_, "ready_s": ready_s, "latencies_s": latencies,
            "first_rps": FIRST / sum(latencies[:FIRST]),
            "all_rps": len(latencies) / sum(latencies), "plans": plans}


def run_served(args: argparse.Namespace) -> dict[str, Any]:
    requests = stream(args.requests + 2, args.seed)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            for mode in rotated(MODES, r):
                runs.append(run_mode(mode, args, requests, log_dir, r))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "latencies_s"}),
                      flush=True)
    return {"runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode the median req/s (first 12, all); auto's per-round ratios to the better static
    mode and their medians."""
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    med = {m: {key: statistics.median(r[key] for r in rs) for key in ("first_rps", "all_rps")}
           for m, rs in by_mode.items()}
    out: dict[str, Any] = {"median": med}
    for key in ("first_rps", "all_rps"):
        better = max(("tp", "dp"), key=lambda m: med[m][key])
        ratios = [a[key] / s[key] for a, s in zip(by_mode["auto"], by_mode[better])]
        out[key] = {"better": better, "ratios": ratios, "median_ratio": statistics.median(ratios)}
    return out


def print_served(out: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"served ViT modes: tp={args.tp}, {args.model_path}, {args.rounds} rounds of "
          f"{args.requests} requests (one 896x896 image / six 224x224 in turn, 1 token)")
    print(f"{'mode':<6}{'first 12 req/s':>16}{'all req/s':>11}  per round (first 12 / all)")
    med = out["summary"]["median"]
    for mode in MODES:
        rounds = [f"{r['first_rps']:.3f}/{r['all_rps']:.3f}" for r in out["runs"]
                  if r["mode"] == mode]
        print(f"{mode:<6}{med[mode]['first_rps']:>16.3f}{med[mode]['all_rps']:>11.3f}  "
              f"{' '.join(rounds)}")
    for key, name in (("first_rps", "first 12"), ("all_rps", f"all {args.requests}")):
        got = out["summary"][key]
        ratios = ", ".join(f"{x:.2f}" for x in got["ratios"])
        print(f"auto / better static ({got['better']}) over the {name}: "
              f"{got['median_ratio']:.2f}x (per round {ratios})")
    plans = [r["plans"] for r in out["runs"] if r["mode"] == "auto"]
    print(f"auto's plans per round: {plans}")


if __name__ == "__main__":  # the same as bench_vit_dp_vs_tp.py --served
    import bench_vit_dp_vs_tp

    bench_vit_dp_vs_tp.main(["--served", *sys.argv[1:]])
