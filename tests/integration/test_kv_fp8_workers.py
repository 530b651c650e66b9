"""fp8, bfloat16 and float16 KV between real workers: a prefill and a decode worker with
--kv-cache-dtype fp8_e4m3 move a quarter of the bytes a float32 pair moves for
the same prompt (half of a bfloat16 pair's), a float32 pair with
--kv-cache-dtype bfloat16 or float16 half, counted by the sender and the receiver; the
split's tokens equal one engine's with the same cache; and an fp8 decode worker
refuses a non-fp8 prefill worker at the layout check, naming the field."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from protos import pb_grpc

from .procs import address, free_port, peer_flag, start_worker
from .test_workers import generate, load

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "A prompt about the tides, the moon and the fishermen who read them. " * 4
KV = ("auto", "fp8_e4m3", "bfloat16", "float16")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    """{kv dtype: (prefill, decode)}: a float32 pair, an fp8 pair, a bfloat16
    and a float16 pair (float32 models), each worker allowed to reach the other role's."""
    tmp = tmp_path_factory.mktemp("fp8")
    ports = {(kv, role): free_port() for kv in KV for role in ("prefill", "decode")}
    other = {"prefill": "decode", "decode": "prefill"}
    procs = {}
    for (kv, role), port in ports.items():
        peers = [address(p) for (_, r), p in ports.items() if r == other[role]]
        extra = ["--local-prefill-threshold", "1"] if role == "decode" else []
        procs[kv, role] = start_worker(role, f"{role[0]}-{kv}", tmp, "--num-blocks", "64", "--grpc-port",
                                       str(port), "--kv-cache-dtype", kv, *extra, *peer_flag(role, peers))
    try:
        for p in procs.values():
            p.wait_ready()
        yield {kv: (procs[kv, "prefill"], procs[kv, "decode"]) for kv in KV}
    finally:
        for p in procs.values():
            p.stop()


def _moved(prefill, decode, rid: str, ids: list[int]) -> tuple[list[int], int, int]:  # type: ignore[no-untyped-def]
    """-> (tokens, bytes the prefill sent, bytes the decode received) for one split request."""
    before_p, before_d = load(prefill.address, pb_grpc.PrefillStub), load(decode.address, pb_grpc.DecodeStub)
    chunks = generate(decode.address, prefill.address, rid, ids, GREEDY)
    assert chunks[0].remote_prefill and chunks[0].cached_tokens == 0
    after_p, after_d = load(prefill.address, pb_grpc.PrefillStub), load(decode.address, pb_grpc.DecodeStub)
    sent = after_p.counters["bytes_sent"] - before_p.counters["bytes_sent"]
    received = after_d.counters["kv_bytes_received"] - before_d.counters["kv_bytes_received"]
    return [t for c in chunks for t in c.token_ids], int(sent), int(received)


def test_fp8_moves_a_quarter_of_float32_and_equals_one_engine(cluster) -> None:  # type: ignore[no-untyped-def]
    fp8 = LLM(dtype="float32", num_blocks=64, num_threads=1, max_model_len=1024, kv_cache_dtype="fp8_e4m3")
    ids = fp8.tokenizer.encode(PROMPT)
    tokens32, sent32, recv32 = _moved(*cluster["auto"], "f32", ids)
    tokens8, sent8, recv8 = _moved(*cluster["fp8_e4m3"], "fp8", ids)
    print(f"\nKV bytes for {len(ids)} prompt tokens: float32 sent {sent32} received {recv32}; "
          f"fp8_e4m3 sent {sent8} received {recv8}")
    blocks = -(-len(ids) // 16)
    assert sent8 == recv8 == blocks * fp8.engine.runner.block_bytes > 0
    assert sent32 == recv32 == 4 * sent8  # float32 -> fp8: a quarter (bfloat16 -> fp8: a half)
    assert tokens8 == fp8.generate(ids, GREEDY)[0].outputs[0].token_ids  # split == monolithic in fp8
    assert len(tokens32) == len(tokens8) == GREEDY.max_tokens


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_half_cache_moves_half_of_float32_and_equals_one_engine(cluster, kv: str) -> None:  # type: ignore[no-untyped-def]
    half = LLM(dtype="float32", num_blocks=64, num_threads=1, max_model_len=1024, kv_cache_dtype=kv)
    assert half.engine.runner.kv_cache.dtype.itemsize == 2
    ids = half.tokenizer.encode(PROMPT.replace("tides", f"winds ({kv})"))  # not in the float32 pair's cache
    _, sent32, recv32 = _moved(*cluster["auto"], f"f32-for-{kv}", ids)
    tokens16, sent16, recv16 = _moved(*cluster[kv], kv, ids)
    print(f"\nKV bytes for {len(ids)} prompt tokens: float32 sent {sent32}; {kv} sent {sent16} "
          f"received {recv16}")
    assert sent16 == recv16 == -(-len(ids) // 16) * half.engine.runner.block_bytes > 0
    assert sent32 == recv32 == 2 * sent16
    assert tokens16 == half.generate(ids, GREEDY)[0].outputs[0].token_ids  # split == monolithic
    assert len(tokens16) == GREEDY.max_tokens


def test_fp8_decode_refuses_a_float32_prefill(cluster) -> None:  # type: ignore[no-untyped-def]
    """The prefill refuses the decode's layout, naming the field; no byte moves,
    and the decode (default policy: recompute) prefills locally in fp8."""
    (p32, _), (_, d8) = cluster["auto"], cluster["fp8_e4m3"]
    ids = list(range(100, 160))
    before_p, before_d = load(p32.address, pb_grpc.PrefillStub), load(d8.address, pb_grpc.DecodeStub)
    chunks = generate(d8.address, p32.address, "mixed", ids, GREEDY)
    after_p, after_d = load(p32.address, pb_grpc.PrefillStub), load(d8.address, pb_grpc.DecodeStub)
    assert [t for c in chunks for t in c.token_ids]  # served all the same
    assert after_p.counters["bytes_sent"] == before_p.counters["bytes_sent"]
    assert after_d.counters["kv_transfer_failures"] == before_d.counters["kv_transfer_failures"] + 1
    computed = after_d.counters["prompt_tokens_computed"] - before_d.counters["prompt_tokens_computed"]
    assert computed == len(ids)
    # local: the prefill's layout, remote: the decode's
    assert ("KV layout mismatch (kv_cache_dtype: local 'float32' vs remote 'float8_e4m3fn')"
            in d8.tail()), d8.tail()
    assert after_d.free_blocks == after_d.total_blocks
