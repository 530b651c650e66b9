"""Combined faults (issue 13): ngram speculation, remote KV and migration in
one request.  A long prompt (prefilled on p0, its KV sent over UCX) streams
from a decode worker that speculates; that worker is SIGKILLed mid-stream;
the frontend resumes the stream on the other one, whose resumed prompt goes
through p0 again and which speculates too.  Greedy: the client gets exactly
the undisturbed tokens, and every block comes back."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from engine import LLM, SamplingParams

from .procs import FrontendProc, Proc, Stream, start_peers, wait_until
from .test_failover import carrier, cluster, frontend_counter, health

MAX_TOKENS = 160
# Repetitive, so that ngram drafts from the prompt get accepted; over 64 tokens: through p0.
PROMPT = ("Repeat the list exactly, line by line, then go on with it: red fox, blue jay, green frog, "
          "red fox, blue jay, green frog, red fox, blue jay, green frog, red fox, blue jay, green frog, "
          "red fox, blue jay, green frog.")
# Fixed k: with adaptive k, two missed drafts pause a request and its sparse probes can all miss,
# so whether the survivor accepts anything would hang on where the kill cuts the stream (after
# 46 of these tokens it accepts none).  With k fixed it accepts drafts for any cut before 132.
SPEC = ["--speculative-method", "ngram", "--num-speculative-tokens", "4", "--no-adaptive-speculation"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[FrontendProc, dict[str, Proc]]]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("combined-faults")
    decode = ["--num-blocks", "128", "--local-prefill-threshold", "32", *SPEC]
    workers = start_peers(tmp, {"p0": ["--num-blocks", "128"], "d0": decode, "d1": decode})
    frontend = FrontendProc(tmp, "frontend", "--decode", f"{workers['d0'].address},{workers['d1'].address}",
                            "--prefill", workers["p0"].address, "--local-prefill-threshold", "32")
    try:
        wait_until(lambda: health(frontend.url).get("healthy_decode_workers") == 2
                   and health(frontend.url).get("healthy_prefill_workers") == 1, 120, frontend.tail())
        yield frontend, workers
    finally:
        frontend.stop()
        for w in workers.values():
            w.stop()


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], list[int]]:
    """The prompt's ids and the undisturbed greedy tokens (offline, no speculation:
    a request run on the stack first would leave the prompt cached where it ran)."""
    llm = LLM(dtype="float32", num_blocks=64, num_threads=1, max_model_len=1024)
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return ids, out[0].outputs[0].token_ids


def counters(url: str) -> dict[str, dict[str, float]]:
    return {name: w["counters"] for name, w in cluster(url).items()}


def test_speculation_remote_kv_and_migration_together(stack, reference) -> None:  # type: ignore[no-untyped-def]
    frontend, workers = stack
    ids, expected = reference
    assert len(ids) > 64
    before = counters(frontend.url)
    migrated = frontend_counter(frontend.url, "splitserve_requests_migrated_total")

    stream = Stream(frontend.grpc_address, ids, MAX_TOKENS)
    stream.start()
    victim = carrier(frontend.url, stream)
    survivor = "d1" if victim == "d0" else "d0"
    # The victim took the KV from p0 and speculates on this stream: wait until it drafted.
    def drafted() -> bool:
        now, then = counters(frontend.url)[victim], before[victim]
        return (now["remote_prefills"] > then["remote_prefills"]
                and now["spec_decode_num_drafts"] > then["spec_decode_num_drafts"])

    wait_until(drafted, 60, "the victim never drafted on the remote-prefilled stream")
    workers[victim].kill(signal.SIGKILL)
    cut_at = len(stream.tokens)
    assert 0 < cut_at < MAX_TOKENS

    assert stream.result() == expected  # nothing lost or repeated, same greedy continuation
    assert frontend_counter(frontend.url, "splitserve_requests_migrated_total") == migrated + 1
    # The resumed prompt (over the threshold) went through p0 again, and the survivor speculated
    # (counted in the survivor's next load report).
    def resumed() -> bool:
        now, then = counters(frontend.url)[survivor], before[survivor]
        return (now["remote_prefills"] > then["remote_prefills"]
                and now["spec_decode_num_accepted_tokens"] > then["spec_decode_num_accepted_tokens"])

    wait_until(resumed, 10, lambda: f"the survivor's counters: {counters(frontend.url)[survivor]}, "
                                    f"before: {before[survivor]}")
    wait_until(lambda: all(w["running"] == 0 and w["free_blocks"] == w["total_blocks"]
                           and w["kv_transfers_pending"] == 0
                           for n, w in cluster(frontend.url).items() if n != victim),
               60, "a worker kept blocks")
    print(f"combined: {victim} killed after {cut_at} of {MAX_TOKENS} tokens; resumed on {survivor}")
