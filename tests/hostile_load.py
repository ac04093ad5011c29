"""The attacks of issue 57 as a load beside ordinary traffic (`scripts/stress.py --attacks`).

Each attack is one client that sends its hostile request(s) once, at its own moment, and checks
that the answer is the request's own: a 400 naming the field for what can never be served, a
200 for what is valid but heavy. A control client sends one small chat every half second for
the whole run and records its latency, so the summary says how long the others waited while
each attack ran.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from hostile_inputs import (
    AMBIGUOUS,
    lark_chain,
    nested_arrays,
    padded_jpeg,
    ref_chain,
    slow_gbnf,
)

CHAT = "/v1/chat/completions"
CONTROL_GAP_S = 0.5


def chat(content: str | list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def padded_images(count: int, segments: int) -> list[dict[str, Any]]:
    url = "data:image/jpeg;base64," + base64.b64encode(padded_jpeg(segments)).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(count)]
    return [*parts, {"type": "text", "text": "What are these?"}]


@dataclass(frozen=True)
class Attack:
    """`count` requests of `body` sent at once, each answered with a status in `expect` (and,
    for a 400, an error naming `param`)."""

    name: str
    body: Callable[[], dict[str, Any]]
    expect: frozenset[int]
    param: str | None = None
    count: int = 1


def attacks(kv_tokens: int) -> list[Attack]:
    """Issue 57's six symptoms, scaled to a server with `kv_tokens` KV slots (n=64 asks for a
    max_tokens that one choice could hold, 64 never)."""
    big = max(16, kv_tokens // 5)  # four of these hold most of the pool
    grammar, schema = frozenset({400}), frozenset({400})
    return [
        Attack("lark_chain", lambda: chat("hi", guided_grammar=lark_chain(3000)), grammar,
               "guided_grammar"),  # fmt: skip
        Attack("ref_chain", lambda: chat("hi", response_format=schema_format(ref_chain(2500))),
               schema, "response_format"),  # fmt: skip
        Attack("nested_130", lambda: chat("hi", guided_json=nested_arrays(130)), schema,
               "guided_json"),  # fmt: skip
        Attack("slow_gbnf", lambda: chat("hi", guided_grammar=slow_gbnf(1990, 7)),
               frozenset({200, 400}), "guided_grammar", count=4),  # fmt: skip
        Attack("ambiguous", lambda: chat("hi", guided_grammar=AMBIGUOUS, min_tokens=300,
               max_tokens=300), grammar, "guided_grammar", count=3),  # fmt: skip
        Attack("n64", lambda: chat("hi", n=64, max_tokens=kv_tokens // 4, ignore_eos=True),
               frozenset({400}), "n"),  # fmt: skip
        Attack("big_outputs", lambda: chat("hi", max_tokens=big, ignore_eos=True),
               frozenset({200}), count=4),  # fmt: skip
        Attack("padded_jpegs", lambda: chat(padded_images(16, 48_000)), frozenset({400}),
               "image_url"),  # fmt: skip
    ]


@dataclass
class AttackLoad:
    url: str
    kv_tokens: int
    outcomes: dict[str, list[str]] = field(default_factory=dict)
    control: list[tuple[float, float, int]] = field(default_factory=list)  # start, s, status
    problems: list[str] = field(default_factory=list)
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def warm_up(self) -> None:
        """One constrained chat: the grammar worker processes start (they start with the first
        constraint), so the children counted before the load include them."""
        resp = httpx.post(self.url + CHAT, json=chat("hi", guided_regex="[0-9]"), timeout=300)
        if resp.status_code != 200:
            raise RuntimeError(f"warm-up constrained chat failed: {resp.text[:300]}")

    def run(self, gap_s: float = 2.0) -> None:
        """Every attack in turn, `gap_s` apart, the control client throughout."""
        done = threading.Event()
        prober = threading.Thread(target=self.probe, args=(done,))
        prober.start()
        launched = []
        try:
            for attack in attacks(self.kv_tokens):
                launched.append(threading.Thread(target=self.attack, args=(attack,)))
                launched[-1].start()
                time.sleep(gap_s)
            for thread in launched:
                thread.join(600)
        finally:
            done.set()
            prober.join()

    def attack(self, attack: Attack) -> None:
        """The attack's `count` requests at once; its window is from the first sent to the
        last answered."""
        start = time.monotonic()
        with ThreadPoolExecutor(attack.count) as pool:
            list(pool.map(lambda _: self.send(attack), range(attack.count)))
        with self.lock:
            self.windows[attack.name] = (start, time.monotonic())

    def send(self, attack: Attack) -> None:
        try:
            resp = httpx.post(self.url + CHAT, json=attack.body(), timeout=600)
        except httpx.HTTPError as exc:  # a reset or a hang: the server failed this client
            self.record(attack.name, f"no answer: {exc!r}", problem=True)
            return
        problem = self.judge(attack, resp)
        self.record(attack.name, str(resp.status_code), problem=bool(problem), why=problem)

    @staticmethod
    def judge(attack: Attack, resp: httpx.Response) -> str:
        """Why this answer is not the request's own ("" when it is)."""
        if resp.status_code not in attack.expect:
            return f"status {resp.status_code}: {resp.text[:200]}"
        if resp.status_code == 200:
            return ""
        error = resp.json().get("error", {})
        if set(error) != {"message", "type", "param", "code"}:
            return f"not OpenAI error JSON: {resp.text[:200]}"
        if resp.status_code == 400 and attack.param and error["param"] != attack.param:
            return f"400 names {error['param']!r}, not {attack.param!r}: {error['message']}"
        return ""

    def record(self, name: str, outcome: str, problem: bool, why: str = "") -> None:
        with self.lock:
            self.outcomes.setdefault(name, []).append(outcome)
            if problem:
                self.problems.append(f"{name}: {why or outcome}")

    def probe(self, done: threading.Event) -> None:
        """One small chat every CONTROL_GAP_S until `done`."""
        body = chat("Hi", max_tokens=4, temperature=0)
        while not done.is_set():
            start = time.monotonic()
            try:
                status = httpx.post(self.url + CHAT, json=body, timeout=120).status_code
            except httpx.HTTPError:
                status = 0
            with self.lock:
                self.control.append((start, time.monotonic() - start, status))
            done.wait(CONTROL_GAP_S)

    def control_during(self, name: str) -> float:
        """The slowest control request that started while attack `name` was in flight."""
        begin, end = self.windows.get(name, (0.0, 0.0))
        during = [s for start, s, _ in self.control if begin <= start <= end]
        return round(max(during, default=0.0), 3)

    def summary(self) -> dict[str, Any]:
        worst = {name: self.control_during(name) for name in self.windows}
        return {
            "outcomes": self.outcomes,
            "control_requests": len(self.control),
            "control_failed": sum(status != 200 for _, _, status in self.control),
            "control_max_s": round(max((s for _, s, _ in self.control), default=0.0), 3),
            "control_max_s_during": worst,
            "problems": self.problems[:10],
        }
