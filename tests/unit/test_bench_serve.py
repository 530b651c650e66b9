"""`splitserve bench serve`'s pure parts: workloads, SSE parsing, per-token
timing, percentiles and goodput, and the dispatcher against a small HTTP/1.1
server on a local socket (tests/unit/http_sse_server.py).  No model."""

from __future__ import annotations

import asyncio
import io
import json
import random
from collections.abc import AsyncIterator

import numpy as np
import pytest

from benchmarks.serve_client import (
    Progress,
    ResponseTimer,
    SSEDecoder,
    Target,
    render_progress,
    request_body,
    run_requests,
)
from benchmarks.serve_stats import (
    RequestResult,
    chunk_token_counts,
    format_table,
    percentile,
    spread_token_times,
    summarize,
    summarize_groups,
)
from benchmarks.serve_workloads import (
    WORDS,
    BenchRequest,
    interference_workload,
    load_replay,
    poisson_arrivals,
    random_workload,
    shared_prefix_workload,
    with_arrivals,
)
from tests.unit.http_sse_server import serve_sse

# -- workloads ------------------------------------------------------------------------


def test_random_workload_is_seeded_and_in_range() -> None:
    a = random_workload(50, 10, 20, 7, seed=3)
    assert a == random_workload(50, 10, 20, 7, seed=3)
    assert a != random_workload(50, 10, 20, 7, seed=4)
    lens = [len(r.prompt.split()) for r in a]
    assert min(lens) >= 10 and max(lens) <= 20 and len(set(lens)) > 3
    assert all(w in WORDS for r in a for w in r.prompt.split())
    assert {r.output_len for r in a} == {7} and all(r.arrival_time is None for r in a)
    with pytest.raises(ValueError, match="input-len"):
        random_workload(1, 20, 10, 7)


def test_shared_prefix_workload_shares_exactly_the_prefix() -> None:
    reqs = shared_prefix_workload(5, 100, 8, 4)
    prefixes = {r.prompt.split("\n")[0] for r in reqs}
    assert len(prefixes) == 1 and len(prefixes.pop().split()) == 100
    suffixes = [r.prompt.split("\n")[1] for r in reqs]
    assert all(len(s.split()) == 8 for s in suffixes) and len(set(suffixes)) == 5


def test_poisson_arrivals() -> None:
    assert poisson_arrivals(4, float("inf")) == [0.0] * 4
    times = poisson_arrivals(4000, 20.0, seed=1)
    assert times == sorted(times) and times == poisson_arrivals(4000, 20.0, seed=1)
    assert 4000 / times[-1] == pytest.approx(20.0, rel=0.05)
    with pytest.raises(ValueError):
        poisson_arrivals(1, 0.0)


def test_interference_workload_mixes_short_and_long() -> None:
    reqs = interference_workload(40, 5, 10, 8, rate=2.0, long_words=300, long_interval=5.0,
                                 long_output_len=2, seed=0)
    shorts = [r for r in reqs if r.group == "short"]
    longs = [r for r in reqs if r.group == "long"]
    assert len(shorts) == 40 and all(r.output_len == 8 for r in shorts)
    span = max(r.arrival_time or 0 for r in shorts)
    assert [r.arrival_time for r in longs] == [2.5 + 5 * i for i in range(len(longs))]
    assert len(longs) == int((span - 2.5) // 5) + 1
    assert all(len(r.prompt.split()) == 300 and r.output_len == 2 for r in longs)
    times = [r.arrival_time for r in reqs]
    assert times == sorted(times)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="finite"):
        interference_workload(4, 5, 10, 8, float("inf"), 300, 5.0, 2)


def test_with_arrivals_fills_only_missing_times() -> None:
    reqs = [BenchRequest("a", 1, 3.0), BenchRequest("b", 1), BenchRequest("c", 1)]
    out = with_arrivals(reqs, 10.0, seed=0)
    assert out[0].arrival_time == 3.0
    assert out[1].arrival_time is not None and out[2].arrival_time is not None
    assert 0 < out[1].arrival_time < out[2].arrival_time
    assert [r.arrival_time for r in with_arrivals(reqs[1:], float("inf"))] == [0.0, 0.0]


def test_load_replay(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt": "hi", "output_len": 3, "arrival_time": 1.5}\n\n'
                    '{"prompt": "yo", "output_len": 2}\n')
    assert load_replay(path) == [BenchRequest("hi", 3, 1.5), BenchRequest("yo", 2, None)]
    path.write_text('{"prompt": "hi", "output_len": 3}\n{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:2"):
        load_replay(path)
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1.*output_len"):
        load_replay(path)


# -- SSE and per-chunk timing ---------------------------------------------------------


def events(decoder: SSEDecoder, lines: list[str]) -> list[str]:
    return [data for line in lines for data in decoder.feed(line)]


def test_sse_decoder() -> None:
    d = SSEDecoder()
    assert events(d, ['data: {"a": 1}', "", ": keep-alive", "", "event: x", "data: one",
                      "data:two\r\n", "", "data: [DONE]"]) == ['{"a": 1}', "one\ntwo"]
    assert list(d.close()) == ["[DONE]"]


def test_request_body_fixes_output_length() -> None:
    req = BenchRequest("hello", 9)
    body = request_body(Target("u", "m", chat=False), req)
    assert body["prompt"] == "hello" and "messages" not in body
    assert body["max_tokens"] == body["min_tokens"] == 9 and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    chat = request_body(Target("u", "m", chat=True), req)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat


def chunk(text: str | None = None, chat: bool = False, **extra: object) -> str:
    if text is None:
        choices = []
    elif chat:
        choices = [{"index": 0, "delta": {"content": text}}]
    else:
        choices = [{"index": 0, "text": text}]
    return json.dumps({"choices": choices, **extra})


def test_response_timer_completions_with_usage() -> None:
    t = ResponseTimer(chat=False)
    stream = [(chunk("A"), 0.5), (chunk(""), 0.55), (chunk(" bb"), 0.7), (chunk(" c"), 0.8),
              (chunk(None, usage={"prompt_tokens": 11, "completion_tokens": 5}), 0.81)]
    assert all(t.on_event(data, at) for data, at in stream)
    assert not t.on_event("[DONE]", 0.82)
    r = t.result("main", start=2.0, end=0.85)
    assert r.ok and r.start == 2.0 and r.ttft == 0.5 and r.e2e == 0.85
    assert r.output_tokens == 5 and r.prompt_tokens == 11
    # 5 tokens over 3 text chunks: the surplus goes to the longest text (" bb")
    assert r.token_times == pytest.approx([0.5, 0.6, 0.7, 0.75, 0.8])
    assert sum(r.itls) == pytest.approx(0.3) and len(r.itls) == 4
    assert r.tpot == pytest.approx((0.85 - 0.5) / 4)


def test_response_timer_chat_without_usage_and_errors() -> None:
    t = ResponseTimer(chat=True)
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for data, at in [(role, 0.1), (chunk("x", chat=True), 0.3), (chunk("y", chat=True), 0.4)]:
        t.on_event(data, at)
    r = t.result("main", 0.0, 0.5)
    assert r.ttft == 0.3 and r.output_tokens == 2 and r.prompt_tokens is None  # the role chunk is no token
    bad = ResponseTimer(chat=False)
    bad.on_event(chunk("x"), 0.1)
    assert not bad.on_event(json.dumps({"error": {"message": "overloaded", "code": 503}}), 0.2)
    r = bad.result("main", 0.0, 0.2)
    assert not r.ok and r.error == "overloaded"
    assert ResponseTimer(chat=False).result("main", 0.0, 0.1).error == "no tokens in the response"


def test_chunk_token_counts() -> None:
    assert chunk_token_counts([], 3) == []
    assert chunk_token_counts([3, 1, 2], 3) == [1, 1, 1]
    assert chunk_token_counts([3, 1, 2], 2) == [1, 1, 1]  # usage undercounts: one each
    counts = chunk_token_counts([4, 4, 8], 7)  # 4 extra: 1, 1, 2
    assert counts == [2, 2, 3] and sum(counts) == 7
    counts = chunk_token_counts([1, 1, 1], 5)  # 2 extra, equal weights: the earlier chunks first
    assert counts == [2, 2, 1]
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randint(0, 9) for _ in range(rng.randint(1, 8))]
        total = rng.randint(0, 40)
        counts = chunk_token_counts(lens, total)
        assert min(counts) >= 1 and sum(counts) == max(total, len(lens))


def test_spread_token_times() -> None:
    times = spread_token_times([1.0, 2.0, 2.6], [1, 2, 3])
    assert times == pytest.approx([1.0, 1.5, 2.0, 2.2, 2.4, 2.6])
    # the first chunk's extra tokens arrive with it: merged, not zero gaps
    assert spread_token_times([1.0, 2.0], [3, 1]) == [1.0, 2.0]
    assert spread_token_times([], []) == []


# -- statistics -----------------------------------------------------------------------


def test_percentile_matches_numpy() -> None:
    rng = random.Random(1)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for p in (0, 50, 90, 99, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def result(ttft: float, gaps: list[float], group: str = "main", ok: bool = True) -> RequestResult:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(group, ok=ok, ttft=ttft, e2e=times[-1], output_tokens=len(times),
                         prompt_tokens=10, token_times=times)


def test_summarize_and_goodput() -> None:
    rs = [result(0.1, [0.01, 0.01]), result(0.2, [0.05, 0.05]), result(0.4, [0.02, 0.02, 0.02]),
          RequestResult("main", ok=False, error="boom")]
    s = summarize(rs, duration=2.0, slo_ttft_ms=250, slo_itl_ms=30)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["output_tokens"] == 10 and s["output_throughput"] == 5.0 and s["request_throughput"] == 1.5
    assert s["input_tokens"] == 30
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(233.33, 0.01)
    assert s["tpot_ms"]["p50"] == pytest.approx(20)
    assert s["itl_ms"]["p90"] == pytest.approx(50) and s["itl_ms"]["mean"] == pytest.approx(180 / 7)
    assert s["e2e_ms"]["p99"] == pytest.approx(300 + 0.98 * 160)  # between ranks 2 and 3
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert d["p50"] <= d["p90"] <= d["p99"]
    # good: only the first (second misses TPOT 50 > 30, third misses TTFT, the failure never counts)
    assert s["goodput"]["good_requests"] == 1 and s["goodput"]["request_goodput"] == 0.5
    assert "goodput" not in summarize(rs, 2.0)
    json.dumps(summarize([RequestResult("main", ok=False)], 1.0), allow_nan=False)  # no NaN in the JSON line


def test_summarize_groups_and_table() -> None:
    rs = [result(0.1, [0.01], "short"), result(0.1, [0.03], "short"), result(2.0, [0.5], "long")]
    s = summarize_groups(rs, 4.0)
    assert set(s["groups"]) == {"short", "long"}
    assert s["groups"]["short"]["itl_ms"]["mean"] == pytest.approx(20)
    assert s["groups"]["long"]["ttft_ms"]["p50"] == pytest.approx(2000)
    table = format_table(s, "title")
    assert "title" in table and "[short]" in table and "TTFT" in table and "ITL" in table
    assert "groups" not in summarize_groups(rs[:2], 1.0)
    one_token = RequestResult("main", ok=True, ttft=0.1, e2e=0.1, output_tokens=1, token_times=[0.1])
    assert "         -" in format_table(summarize([one_token], 1.0))  # no TPOT for 1 token


def test_progress() -> None:
    assert render_progress(5, 10, 0, 3.2, width=10) == "[#####.....] 5/10 done, 3 s"
    assert render_progress(10, 10, 2, 61, width=4) == "[####] 10/10 done, 2 failed, 61 s"
    out = io.StringIO()  # not a terminal: only the final line
    p = Progress(3, stream=out)
    for ok in (True, False, True):
        p.update(ok)
    p.close()
    assert out.getvalue().count("\n") == 1 and "3/3 done, 1 failed" in out.getvalue()


# -- the dispatcher, against a fake streaming server -------------------------------------


def fake_completions(delay: float, in_flight: list[int]):  # type: ignore[no-untyped-def]
    """A completions handler for serve_sse: one chunk per requested token,
    `delay` apart; records how many requests are in flight at each start."""
    live = [0]

    async def handler(body: dict) -> AsyncIterator[bytes]:  # type: ignore[type-arg]
        live[0] += 1
        in_flight.append(live[0])
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(delay)
            yield f"data: {chunk('w')}\n\n".encode()
        live[0] -= 1  # before the last event: the client closes the stream on [DONE]
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": body["max_tokens"]}
        yield f"data: {chunk(None, usage=usage)}\n\ndata: [DONE]\n\n".encode()

    return handler


def run_against(handler, reqs: list[BenchRequest], concurrency: int | None):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        async with serve_sse(handler) as url:
            return await run_requests(Target(f"{url}/v1/completions", "m", chat=False), reqs,
                                      concurrency=concurrency, timeout=10,
                                      progress=Progress(len(reqs), enabled=False))
    return asyncio.run(main())


def test_run_requests_honors_concurrency_and_counts_tokens() -> None:
    in_flight: list[int] = []
    reqs = [BenchRequest(f"p {i}", 3, 0.0) for i in range(6)]
    results, duration = run_against(fake_completions(0.01, in_flight), reqs, concurrency=2)
    assert max(in_flight) == 2 and len(in_flight) == 6
    assert all(r.ok and r.output_tokens == 3 and r.prompt_tokens == 2 for r in results)
    assert all(len(r.itls) == 2 and r.ttft > 0 for r in results)
    assert duration >= 3 * 3 * 0.01  # three waves of two


def test_run_requests_sends_at_arrival_times() -> None:
    reqs = [BenchRequest("late", 1, 0.2), BenchRequest("early", 1, 0.0)]
    results, _ = run_against(fake_completions(0.0, []), reqs, concurrency=None)
    assert results[1].start < 0.1 and results[0].start >= 0.19  # results in request order


def test_plot_compare_draws_every_system_or_says_it_cannot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    from benchmarks.serve import plot_compare
    from benchmarks.serve_stats import RequestResult, summarize

    def run(scale: float) -> tuple[dict, list[RequestResult]]:  # type: ignore[type-arg]
        results = [RequestResult(group=g, ok=True, start=i * 0.5, ttft=0.1 * scale, e2e=1.0 * scale,
                                 output_tokens=4, token_times=[0.1 * scale * k for k in range(1, 5)])
                   for i, g in enumerate(["short", "long"] * 3)]
        return summarize(results, duration=4.0), results

    path = tmp_path / "mixed.png"
    drawn = plot_compare({"a": run(1.0), "b": run(2.0)}, str(path), "mixed: a, b")
    if importlib.util.find_spec("matplotlib") is None:
        assert drawn is False and not path.exists()
    else:
        assert drawn is True and path.stat().st_size > 10_000
