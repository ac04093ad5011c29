"""The served ViT modes benchmark's pure parts (scripts/vit_served.py): issue 54's stream of
requests and the summary of auto against the better static mode."""

from __future__ import annotations

import vit_served as served  # scripts/ is on sys.path (conftest)


def test_the_stream_alternates_one_large_and_six_small_new_images() -> None:
    requests = served.stream(4, seed=0)
    assert [len(r) for r in requests] == [1, 6, 1, 6]
    urls = [url for r in requests for url in r]
    assert len(set(urls)) == len(urls)  # every image new: no cache hit in any mode
    body = served.payload("m", requests[1])
    assert body["max_tokens"] == 1 and len(body["messages"][0]["content"]) == 7


def run(mode: str, round_: int, first: float, all_: float) -> dict:
    return {"mode": mode, "round": round_, "first_rps": first, "all_rps": all_}


def test_auto_is_compared_per_round_with_the_better_static_mode() -> None:
    """TP is better over the first 12 and DP over all requests: each ratio is against its own
    better mode, round by round."""
    runs = [run("tp", 0, 2.0, 1.0), run("dp", 0, 1.0, 2.0), run("auto", 0, 1.0, 1.0),
            run("tp", 1, 4.0, 1.0), run("dp", 1, 1.0, 4.0), run("auto", 1, 4.0, 2.0)]
    out = served.summarize(runs)
    assert out["median"]["tp"] == {"first_rps": 3.0, "all_rps": 1.0}
    assert out["first_rps"]["better"] == "tp" and out["first_rps"]["ratios"] == [0.5, 1.0]
    assert out["all_rps"]["better"] == "dp" and out["all_rps"]["ratios"] == [0.5, 0.5]
    assert out["first_rps"]["median_ratio"] == 0.75
