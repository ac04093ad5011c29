"""llguidance and xgrammar side by side: compile time (cold and cached) and mask time per token.

    python scripts/bench_grammar.py                      # tiny vocabulary + a 151,643-token one
    python scripts/bench_grammar.py --tokenizer PATH     # a real tokenizer.json as the large one

Workload: the constraints of scripts/grammar_cases.py (12 JSON schemas, json_object, 3 regexes,
a choice, an EBNF grammar). For each engine and vocabulary every constraint is compiled cold and
again (cached), then decoded by a noise "model" (random logits, the engine's mask, sampling at
temperature 1) for --seeds seeds until the grammar ends; each output is checked (jsonschema,
full match, choice). Mask time is the thread CPU time of filling one bitmask row, per token;
compile time is wall time (engines may compile on threads of their own).

Vocabularies: the tiny checkpoints' 382-token BPE (512 logits), and a Qwen2-size one: a
151,643-token byte-level BPE with Qwen2's split rule, trained once (about 3 min, then cached) on the
Python sources installed on this machine, since no real Qwen tokenizer can be fetched offline;
its tokens are code and English fragments of realistic lengths, which is what mask cost depends on.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch
import xgrammar
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from grammar_cases import CHOICES, EBNF, EBNF_PATTERN, REGEXES, SCHEMAS  # noqa: E402

from runtime.grammar import GrammarCompiler, GrammarSpec, make_backend  # noqa: E402
from runtime.grammar.bitmask import (  # noqa: E402
    BatchMask,  # noqa: E402
    allocate_bitmask,
    apply_bitmask,
)
from runtime.tiny_checkpoint import SPECIAL_TOKENS, SPLIT_REGEX, build_tokenizer  # noqa: E402

QWEN2_VOCAB = 151_643
MAX_STEPS = 2000
CACHE = Path.home() / ".cache" / "tessera" / "grammar_bench_vocab.json"


@dataclass
class Case:
    name: str
    spec: GrammarSpec
    check: Callable[[str], bool]


def cases() -> list[Case]:
    out = [
        Case(f"schema{i}", GrammarSpec.json_schema(s), schema_check(s))
        for i, s in enumerate(SCHEMAS)
    ]
    out.append(Case("json_object", GrammarSpec("json_object", ""), object_check))
    out += [
        Case(f"regex{i}", GrammarSpec("regex", r), regex_check(r)) for i, r in enumerate(REGEXES)
    ]
    out.append(Case("choice", GrammarSpec.choice(CHOICES), lambda text: text in CHOICES))
    out.append(Case("ebnf", GrammarSpec("ebnf", EBNF), regex_check(EBNF_PATTERN)))
    return out


def schema_check(schema: dict) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def object_check(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def regex_check(pattern: str) -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None


# ----------------------------------------------------------------------------- vocabularies


def python_sources(limit: int) -> Iterator[str]:
    files = sorted(glob.glob(f"{sys.base_prefix}/lib/python3*/**/*.py", recursive=True))
    files += sorted(glob.glob(f"{sys.prefix}/lib/python3*/site-packages/**/*.py", recursive=True))
    total = 0
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text
        if total > limit:
            return


def train_large_vocab() -> Tokenizer:
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = BpeTrainer(
        vocab_size=QWEN2_VOCAB, min_frequency=2, show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator(python_sources(150_000_000), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def large_tokenizer(path: str | None) -> Tokenizer:
    if path:
        return Tokenizer.from_file(path)
    if not CACHE.exists():
        print(f"training a {QWEN2_VOCAB}-token BPE (cached in {CACHE}) ...", flush=True)
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        train_large_vocab().save(str(CACHE))
    return Tokenizer.from_file(str(CACHE))


# ----------------------------------------------------------------------------- engines


class Engine:
    """What the benchmark needs of an engine: compile, a matcher, fill a row, accept a token."""

    name: str

    def compile(self, case: Case) -> object: ...
    def matcher(self, compiled: object) -> object: ...
    def fill(self, matcher: object, bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: object, token: int) -> bool: ...
    def done(self, matcher: object) -> bool: ...


class LLGuidanceEngine(Engine):
    """tessera's own backend and compiler (what the server will run)."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab: int, stops: list[int]) -> None:
        self.compiler = GrammarCompiler(make_backend("llguidance", tok.to_str(), vocab, stops))

    def compile(self, case: Case) -> object:
        return self.compiler.compile(case.spec)

    def matcher(self, compiled: object) -> object:
        return self.compiler.backend.new_matcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class XGrammarEngine(Engine):
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab: int, stops: list[int]) -> None:
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=stops)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)

    def compile(self, case: Case) -> object:
        kind, text = case.spec.kind, case.spec.text
        if kind == "json_schema":
            return self.compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        return self.compiler.compile_grammar(text)

    def matcher(self, compiled: object) -> object:
        return xgrammar.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


# ----------------------------------------------------------------------------- measuring


@dataclass
class Result:
    compile_cold_ms: list[float] = field(default_factory=list)
    compile_cached_ms: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)


def timed_ms(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - start) * 1000


def decode(engine: Engine, compiled: object, vocab: int, seed: int, mask_us: list[float]):
    """Noise-model decoding under the engine's mask; the tokens, or None if it did not end."""
    matcher, gen = engine.matcher(compiled), torch.Generator().manual_seed(seed)
    bitmask, rows, tokens = allocate_bitmask(1, vocab), torch.tensor([0]), []
    for _ in range(MAX_STEPS):
        if engine.done(matcher):
            return tokens
        start = time.thread_time_ns()
        engine.fill(matcher, bitmask)
        mask_us.append((time.thread_time_ns() - start) / 1000)
        logits = torch.randn(1, vocab, generator=gen) * 3
        apply_bitmask(logits, BatchMask(bitmask, rows))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if not engine.accept(matcher, token):
            raise RuntimeError(f"{engine.name} refused a token its own mask allowed")
        tokens.append(token)
    return None


def run_case(engine: Engine, case: Case, tok: Tokenizer, args, res: Result) -> None:
    try:
        compiled, cold = timed_ms(lambda: engine.compile(case))
    except (ValueError, RuntimeError) as exc:
        res.failed.append(f"{case.name}: {str(exc).splitlines()[0][:80]}")
        return
    res.compile_cold_ms.append(cold)
    res.compile_cached_ms.append(timed_ms(lambda: engine.compile(case))[1])
    stops = set(args.stops)
    for seed in range(args.seeds):
        tokens = decode(engine, compiled, args.vocab, seed, res.mask_us)
        if tokens is None:
            res.unfinished.append(f"{case.name}/{seed}")
            continue
        text = tok.decode([t for t in tokens if t not in stops], skip_special_tokens=False)
        if not case.check(text):
            res.invalid.append(f"{case.name}/{seed}: {text[:60]!r}")


ENGINES: dict[str, type[Engine]] = {"llguidance": LLGuidanceEngine, "xgrammar": XGrammarEngine}


def bench_vocab(label: str, tok: Tokenizer, vocab: int, opts: argparse.Namespace) -> None:
    stops = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    args = argparse.Namespace(vocab=vocab, seeds=opts.seeds, stops=stops)
    for cls in (ENGINES[name] for name in opts.engines.split(",")):
        setup_start = time.perf_counter()
        engine = cls(tok, vocab, stops)
        setup_ms = (time.perf_counter() - setup_start) * 1000
        res = Result()
        for case in cases():
            run_case(engine, case, tok, args, res)
        report(label, cls.name, setup_ms, res)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(label: str, engine: str, setup_ms: float, res: Result) -> None:
    mask = res.mask_us
    print(
        f"{label:>14} {engine:>10} | tokenizer setup {setup_ms:8.1f} ms | compile cold "
        f"mean {statistics.fmean(res.compile_cold_ms):7.2f} max {max(res.compile_cold_ms):7.2f} ms"
        f" | cached mean {statistics.fmean(res.compile_cached_ms):6.3f} ms | mask per token "
        f"mean {statistics.fmean(mask):7.1f} p50 {pct(mask, 0.5):7.1f} p99 {pct(mask, 0.99):8.1f}"
        f" us over {len(mask)} tokens | compiled {len(res.compile_cold_ms)}/"
        f"{len(res.compile_cold_ms) + len(res.failed)}, invalid {len(res.invalid)}, "
        f"unfinished {len(res.unfinished)}",
        flush=True,
    )
    for line in res.failed + res.invalid + res.unfinished:
        print(f"{'':>27} {line}")


def bench_apply(vocab: int, batch: int = 32, repeat: int = 20) -> None:
    """`apply_bitmask` on a batch of `batch` logits rows with 0%, 50% and 100% constrained."""
    cells = []
    for share in (0.0, 0.5, 1.0):
        rows = torch.arange(0, batch, 2 if share == 0.5 else 1)[: int(batch * share)]
        bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), (vocab + 31) // 32))
        mask = BatchMask(bitmask.to(torch.int32), rows) if len(rows) else None
        logits = torch.randn(batch, vocab)
        start = time.thread_time_ns()
        for _ in range(repeat):
            apply_bitmask(logits, mask)
        cells.append(f"{share:.0%} {(time.thread_time_ns() - start) / repeat / 1e6:.2f} ms")
    print(f"apply_bitmask, {batch} rows x {vocab} logits, constrained: " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tokenizer", help="a tokenizer.json to use as the large vocabulary")
    parser.add_argument("--tiny-only", action="store_true", help="skip the large vocabulary")
    parser.add_argument("--large-only", action="store_true", help="skip the tiny vocabulary")
    parser.add_argument("--engines", default="llguidance,xgrammar", help="in this order")
    parser.add_argument("--apply-only", action="store_true", help="only time apply_bitmask")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.apply_only:
        return bench_apply(QWEN2_VOCAB + len(SPECIAL_TOKENS))
    if not args.large_only:
        bench_vocab("tiny (512)", build_tokenizer(), 512, args)
    if not args.tiny_only:
        tok = large_tokenizer(args.tokenizer)
        bench_vocab(f"large ({tok.get_vocab_size()})", tok, tok.get_vocab_size(), args)
        bench_apply(tok.get_vocab_size())


if __name__ == "__main__":
    main()
