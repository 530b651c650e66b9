"""The benchmarks' A B B A rounds: each system runs once per round, every other
round in reverse order (a palindrome, so a linear drift of the host's speed
weighs on every system alike), each round on prompts of its own (a seed no
round before used: none in a prefix cache), and a system's figure is its rounds'
tokens over their summed seconds."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.offline import make_prompts, run_rounds
from benchmarks.serve_stats import RequestResult
from benchmarks.targets import Runner, decode_fractions


def test_offline_rounds_reverse_the_order_and_pool_tokens_over_seconds() -> None:
    calls: list[tuple[str, int]] = []

    def system(name: str, seconds: float) -> Any:
        def run(batch: list[list[int]]) -> dict[str, float]:
            calls.append((name, batch[0][0]))
            return {"seconds": seconds, "output_tokens": 100, "output_tok_s": 100 / seconds}
        return run

    seeds = {i: make_prompts(2, 4, 8, 1000, seed=i) for i in range(4)}
    assert seeds[0] != seeds[1]
    rows = run_rounds({"a": system("a", 1.0), "b": system("b", 4.0), "c": system("c", 2.0)},
                      seeds.__getitem__, 4)
    names = [n for n, _ in calls]
    assert names == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    # every system of a round got that round's prompts
    assert [first for _, first in calls] == [seeds[i][0][0] for i in range(4) for _ in range(3)]
    assert rows["a"]["output_tok_s"] == pytest.approx(400 / 4.0)
    assert rows["b"]["output_tok_s"] == pytest.approx(400 / 16.0)
    assert rows["b"]["rounds"] == [25.0] * 4


class RecordingRunner(Runner):
    """Records what the runner would send to each server (the servers are the
    real bench's concern; the order and pooling are this test's)."""

    def __init__(self, tmp: Path, seconds: dict[str, float]) -> None:
        super().__init__(argparse.Namespace(quick=False), tmp)
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.seconds = seconds

    def bench(self, server: Any, workload: str,
              extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[Any]]:
        self.calls.append((server.label, extra))
        done = [RequestResult("all", True, e2e=1.0, ttft=0.1, output_tokens=10) for _ in range(4)]
        return {"duration_s": self.seconds[server.label]}, done


def test_abba_runs_the_whole_workload_per_round_in_a_palindrome(tmp_path: Path) -> None:
    r = RecordingRunner(tmp_path, {"ours": 2.0, "vllm": 5.0})
    got = r.bench_abba([SimpleNamespace(label="ours"), SimpleNamespace(label="vllm")],  # type: ignore[list-item]
                       "mixed")
    assert r.calls == [("ours", ("--seed", "0")), ("vllm", ("--seed", "0")),
                       ("vllm", ("--seed", "1")), ("ours", ("--seed", "1"))]
    assert got["ours"]["output_throughput"] == pytest.approx(80 / 4.0)  # 2 rounds x 4 requests x 10 tokens
    assert got["vllm"]["output_throughput"] == pytest.approx(80 / 10.0)


def test_abba_alone_runs_once(tmp_path: Path) -> None:
    r = RecordingRunner(tmp_path, {"ours": 2.0})
    r.bench_abba([SimpleNamespace(label="ours")], "mixed")  # type: ignore[list-item]
    assert r.calls == [("ours", ("--seed", "0"))]


def test_paired_takes_requests_in_turn_and_no_server_twice_in_a_row(tmp_path: Path) -> None:
    """A server's request right after its own ran 15-30% faster (its weights
    still in cache): each round's order is the last one's rotated."""
    r = RecordingRunner(tmp_path, {"ours": 1.0, "vllm": 1.0, "llama.cpp": 1.0})
    r.bench_paired([SimpleNamespace(label=x) for x in ("ours", "vllm", "llama.cpp")],  # type: ignore[misc]
                   "single")
    labels = [label for label, _ in r.calls]
    assert labels == ["ours", "vllm", "llama.cpp", "vllm", "llama.cpp", "ours",
                      "llama.cpp", "ours", "vllm", "ours", "vllm", "llama.cpp"]
    assert all(a != b for a, b in zip(labels, labels[1:], strict=False))
    # request i: the same prompt (seed i) for every server
    assert [extra for _, extra in r.calls] == [("--num-prompts", "1", "--seed", str(i)) for i in range(4)
                                               for _ in range(3)]
    two = RecordingRunner(tmp_path, {"ours": 1.0, "vllm": 1.0})
    two.bench_paired([SimpleNamespace(label=x) for x in ("ours", "vllm")], "single")  # type: ignore[misc]
    assert [label for label, _ in two.calls] == ["ours", "vllm"] * 4


def test_a_later_pairing_sends_prompts_no_server_has_seen(tmp_path: Path) -> None:
    """vLLM and llama.cpp stay up across our stacks and cache prefixes: a second
    pairing on the seeds of the first served them from their caches."""
    r = RecordingRunner(tmp_path, {"disagg": 2.0, "coloc": 2.0, "vllm": 5.0})
    r.bench_abba([SimpleNamespace(label="disagg"), SimpleNamespace(label="vllm")], "mixed")  # type: ignore[list-item]
    r.bench_abba([SimpleNamespace(label="coloc"), SimpleNamespace(label="vllm")], "mixed")  # type: ignore[list-item]
    vllm_seeds = [extra[-1] for label, extra in r.calls if label == "vllm"]
    assert vllm_seeds == ["0", "1", "2", "3"]
    assert [extra[-1] for label, extra in r.calls if label == "coloc"] == ["2", "3"]


def test_rounds_beside_the_peak_alternate_and_hold_each_round_to_its_own_minutes(tmp_path: Path) -> None:
    """Target 3: the peak before the first round, between rounds and after the
    last; each round against the better of the two beside it, never the run's."""
    r = RecordingRunner(tmp_path, {"ours": 2.0})
    order: list[str] = []
    peaks = iter([400e9, 300e9, 440e9, 420e9])

    def peak() -> dict[str, float]:
        order.append("peak")
        return {"bfloat16 packed kernel": next(peaks), "float32 torch": 100e9}

    real_bench = r.bench

    def bench(server: Any, workload: str, extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[Any]]:
        order.append(f"run {extra[-1]}")
        summary, done = real_bench(server, workload, extra)
        tpot = {"0": 40.0, "1": 50.0, "2": 35.0}[extra[-1]]
        return {**summary, "tpot_ms": {"p50": tpot}, "output_tokens": 320, "input_tokens": 320,
                "completed": 32}, done

    r.bench = bench  # type: ignore[method-assign]
    rounds = r.bench_beside_peak(SimpleNamespace(label="ours"), "decode32", 3, peak)  # type: ignore[arg-type]
    assert order == ["peak", "run 0", "peak", "run 1", "peak", "run 2", "peak"]
    assert [rd.peak("bfloat16")[1] for rd in rounds] == [400e9, 440e9, 440e9]
    params, layers, qdim = 100_000_000, 10, 64
    fractions = decode_fractions(rounds, "bfloat16", params, layers, qdim)
    per_token = 2 * params + 4 * layers * qdim * (10 + 10 / 2)
    expect = [32 / (tpot / 1e3) * per_token / p for tpot, p in ((40.0, 400e9), (50.0, 440e9), (35.0, 440e9))]
    assert fractions == pytest.approx(expect)
    assert r.results["ours / decode32"]["completed"] == 12  # the three rounds pooled
