"""Prefill and decode workers as real processes, talking gRPC, KV over real
UCX: the split's tokens equal the offline engine's (invariant 5), and the KV
really crosses (decode computes no prompt token of a remote-prefilled request)."""

from __future__ import annotations

import os

import grpc
import pytest

from engine import LLM, SamplingParams
from protos import pb, pb_grpc
from services.convert import sampling_to_proto

from .procs import start_pair, stop_all, thread_policies

THRESHOLD = 32
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3,
    "List the planets of the solar system in order from the sun, with one fact about each. " * 2,
    "Hi there!",  # under the threshold: prefilled on the decode worker
]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("workers")
    procs = start_pair(tmp, ["--num-blocks", "128"],
                       ["--num-blocks", "128", "--local-prefill-threshold", str(THRESHOLD)])
    try:
        yield list(procs)
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def offline():  # type: ignore[no-untyped-def]
    return LLM(dtype="float32", num_blocks=128, num_threads=1, max_model_len=1024)


def load(address: str, stub_cls) -> pb.LoadReport:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(address) as ch:
        return next(iter(stub_cls(ch).WatchLoad(pb.LoadRequest(interval_seconds=0.1))))


def generate(decode: str, prefill: str, rid: str, ids: list[int], params: SamplingParams):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(decode) as ch:
        req = pb.WorkerGenerateRequest(request_id=rid, prompt_token_ids=ids,
                                       sampling=sampling_to_proto(params), prefill_address=prefill)
        return list(pb_grpc.DecodeStub(ch).Generate(req, timeout=120))


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_split_tokens_equal_offline(workers, offline) -> None:  # type: ignore[no-untyped-def]
    p0, d0 = workers
    for i, prompt in enumerate(PROMPTS):
        ids = offline.tokenizer.encode(prompt)
        ref = offline.generate(ids, GREEDY)[0].outputs[0]
        chunks = generate(d0.address, p0.address, f"r{i}", ids, GREEDY)
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == ref.token_ids
        assert "".join(c.text for c in chunks) == ref.text
        assert chunks[-1].finish_reason == "length"
        assert all(c.remote_prefill == (len(ids) >= THRESHOLD) for c in chunks)


def test_kv_really_crosses(workers, offline) -> None:  # type: ignore[no-untyped-def]
    p0, d0 = workers
    ids = offline.tokenizer.encode("A fresh prompt about mountains and rivers, never seen before. " * 4)
    before_d = load(d0.address, pb_grpc.DecodeStub)
    before_p = load(p0.address, pb_grpc.PrefillStub)
    chunks = generate(d0.address, p0.address, "cross", ids, GREEDY)
    assert chunks[0].remote_prefill and chunks[0].cached_tokens == 0
    after_d = load(d0.address, pb_grpc.DecodeStub)
    after_p = load(p0.address, pb_grpc.PrefillStub)
    assert after_d.counters["prompt_tokens_computed"] == before_d.counters["prompt_tokens_computed"]
    computed_p = after_p.counters["prompt_tokens_computed"] - before_p.counters["prompt_tokens_computed"]
    assert computed_p == len(ids)
    num_blocks = -(-len(ids) // 16)
    layout = offline.engine.runner
    sent = after_p.counters["bytes_sent"] - before_p.counters["bytes_sent"]
    assert sent == num_blocks * layout.block_bytes
    assert after_d.counters["kv_bytes_received"] - before_d.counters["kv_bytes_received"] == sent
    assert after_d.free_blocks == after_d.total_blocks
    assert after_p.free_blocks == after_p.total_blocks


def test_metrics_endpoint(workers) -> None:  # type: ignore[no-untyped-def]
    import urllib.request

    for proc, stub_cls in zip(workers, (pb_grpc.PrefillStub, pb_grpc.DecodeStub), strict=True):
        with grpc.insecure_channel(proc.address) as ch:
            info = stub_cls(ch).Info(pb.InfoRequest())
        assert info.metrics_url.startswith("http://127.0.0.1:")
        text = urllib.request.urlopen(info.metrics_url, timeout=5).read().decode()
        labels = f'model_name="SmolLM2-135M-Instruct",role="{info.role}",worker_id="{info.worker_id}"'
        assert f"splitserve_kv_cache_total_blocks{{{labels}}} 128.0" in text
        assert "splitserve_prompt_tokens_computed_total" in text


def test_bad_sampling_is_invalid_argument_and_worker_keeps_serving(workers, offline) -> None:  # type: ignore[no-untyped-def]
    p0, d0 = workers
    with grpc.insecure_channel(d0.address) as ch:
        stub = pb_grpc.DecodeStub(ch)
        bad = pb.WorkerGenerateRequest(request_id="bad", prompt_token_ids=[1, 2, 3],
                                       sampling=pb.SamplingParams(top_p=3.0))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
        too_long = pb.WorkerGenerateRequest(request_id="long", prompt_token_ids=[5] * 2000,
                                            sampling=sampling_to_proto(GREEDY),
                                            prefill_address=p0.address)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(too_long, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.details()
    ids = offline.tokenizer.encode(PROMPTS[0])
    assert [t for c in generate(d0.address, p0.address, "after", ids, GREEDY) for t in c.token_ids] == \
        offline.generate(ids, GREEDY)[0].outputs[0].token_ids


def test_serving_threads_run_behind_the_engine(workers, offline) -> None:  # type: ignore[no-untyped-def]
    # After a request has run (the kernels' own threads exist), each worker's
    # engine thread and kernel threads keep the default policy; its main
    # thread (the event loop) and the threads it started after the engine
    # (gRPC, UCX) run under SCHED_BATCH (services/sched_policy.py).
    p0, d0 = workers
    ids = offline.tokenizer.encode(PROMPTS[0])
    assert generate(d0.address, p0.address, "sched", ids, GREEDY)
    for proc in (p0, d0):
        pid = proc.popen.pid
        threads = thread_policies(pid)
        names = [n for n, _ in threads.values()]
        assert names.count("ss-engine") == 1, threads
        compute = {t: p for t, (n, p) in threads.items() if n in ("ss-engine", "ss-kernel")}
        assert set(compute.values()) == {os.SCHED_OTHER}, threads
        assert threads[pid][1] == os.SCHED_BATCH, threads  # the main thread: the event loop
        serving = [t for t, (n, p) in threads.items() if t not in compute and p == os.SCHED_BATCH]
        assert len(serving) >= 3, threads  # the loop, and the gRPC and UCX threads it started
