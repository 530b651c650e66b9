"""What structured output costs the requests beside it: one engine decodes a
batch of 16 greedy requests, either all plain (A) or 8 plain + 8 with a JSON
schema (B), in interleaved rounds (A B A B ...) in one run; reported: the plain
requests' inter-token latency, p50 and p99, median over the rounds.

    python -m benchmarks.guided_itl                  # 4 rounds of each, 48 tokens
    python -m benchmarks.guided_itl --rounds 6 --json

Only steps in which all 16 requests produced a token count (a batch the same
size in both configurations); the schema asks for a long array, so the guided
requests run as long as the plain ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

BATCH = 16
SCHEMA = {
    "type": "object", "required": ["cities"],
    "properties": {"cities": {
        "type": "array", "minItems": 30,
        "items": {"type": "object", "required": ["name", "country", "population"],
                  "properties": {"name": {"type": "string", "maxLength": 24},
                                 "country": {"type": "string", "enum": ["NO", "SE", "DK", "FI", "IS"]},
                                 "population": {"type": "integer", "minimum": 0, "maximum": 10_000_000}}}}},
}
TOPICS = ["Norway", "Sweden", "Denmark", "Finland", "Iceland", "the Alps", "Japan", "Chile"]


def prompts(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer.encode(f"List the largest cities of {TOPICS[i % len(TOPICS)]} as JSON, "
                                  f"request {i}.")) for i in range(BATCH)]


def run_batch(engine: Any, ids: list[list[int]], guided: list[Any], max_tokens: int, tag: str,
              ) -> tuple[list[float], int]:
    """-> (the plain requests' inter-token gaps in seconds, steps counted)."""
    from engine import SamplingParams

    plain = set()
    for i, (prompt, g) in enumerate(zip(ids, guided, strict=True)):
        rid = f"{tag}-{i}"
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                       guided=g))
        if g is None:
            plain.add(rid)
    last: dict[str, float] = {}
    gaps: list[float] = []
    full_steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        full = len(outs) == len(ids)
        full_steps += full
        for o in outs:
            if full and o.request_id in plain and o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
    return gaps, full_steps


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="rounds of each configuration, interleaved")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens each request generates")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    from engine import LLM
    from engine.vocab.guided_params import GuidedDecoding

    llm = LLM(dtype=args.dtype, num_threads=args.num_threads, num_blocks=512, max_num_seqs=BATCH)
    engine = llm.engine
    ids = prompts(llm.tokenizer)
    schema = GuidedDecoding.json_schema(json.dumps(SCHEMA))
    configs: dict[str, list[Any]] = {"A: 16 plain": [None] * BATCH,
               "B: 8 plain + 8 JSON schema": [None, schema] * (BATCH // 2)}
    engine.grammars.compile(schema)  # compiled once, as a worker's cache would hold it
    for name, guided in configs.items():  # warm-up: kernels, the prefix cache, the matcher
        run_batch(engine, ids, guided, 4, f"warm-{name[0]}")
    rounds: dict[str, list[tuple[float, float, int]]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, guided in configs.items():
            gaps, steps = run_batch(engine, ids, guided, args.max_tokens, f"{name[0]}{r}")
            rounds[name].append((percentile(gaps, 0.5) * 1e3, percentile(gaps, 0.99) * 1e3, steps))
            print(f"round {r + 1} {name}: p50 {rounds[name][-1][0]:.2f} ms, p99 {rounds[name][-1][1]:.2f} ms",
                  file=sys.stderr, flush=True)  # a long run on a busy machine shows it is moving
    result: dict[str, Any] = {}
    for name, rs in rounds.items():
        result[name] = {"itl_p50_ms": statistics.median(x[0] for x in rs),
                        "itl_p99_ms": statistics.median(x[1] for x in rs),
                        "rounds_p50_ms": [round(x[0], 2) for x in rs],
                        "full_steps": [x[2] for x in rs]}
    a, b = (result[name] for name in configs)
    result["p50_ratio"] = b["itl_p50_ms"] / a["itl_p50_ms"]
    result["p99_ratio"] = b["itl_p99_ms"] / a["itl_p99_ms"]
    result["dtype"] = str(engine.runner.model_dtype).removeprefix("torch.")
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"plain requests' ITL, batch of {BATCH}, {args.max_tokens} tokens, median of {args.rounds} "
          f"interleaved rounds ({result['dtype']}):")
    print(f"{'configuration':<30} {'p50 ms':>8} {'p99 ms':>8}  per-round p50")
    for name in configs:
        r = result[name]
        print(f"{name:<30} {r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f}  {r['rounds_p50_ms']}")
    print(f"B / A: p50 {result['p50_ratio']:.3f}, p99 {result['p99_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
