"""Mid-rollout routing (issue 19, acceptance 5): workers on two weight versions
(model_ids that differ in their digest) never pair for a KV transfer, and a
stream that migrates moves only to a decode worker of its own version."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.vocab.sampling_params import SamplingParams
from protos import pb
from services.frontend.dispatch import Dispatcher, Job
from services.frontend.errors import APIError
from services.frontend.metrics import Metrics
from services.frontend.router import LoadRouter
from services.frontend.worker_pool import WorkerPool

V1, V2 = "smol-aaaaaaaaaaaa", "smol-bbbbbbbbbbbb"
JOB = Job(0, 0, list(range(40)), SamplingParams(temperature=0, max_tokens=4), "r", 0, "")


def pool_of(workers: dict[str, tuple[str, str, int]]) -> WorkerPool:
    """address -> (role, model_id, running): workers that look up and reported."""
    pool = WorkerPool((), (), interval=60)
    for role in ("decode", "prefill"):
        group = pool.decodes if role == "decode" else pool.prefills
        for address, (r, model_id, running) in workers.items():
            if r == role:
                w = group[address] = pool._worker(address, role)
                w.info = pb.WorkerInfo(role=role, model_id=model_id, layout=pb.KVLayout(
                    model_id=model_id, dtype="float32", kv_cache_dtype="float32", block_size=16))
                w.load, w.last_report, w.stream_up = pb.LoadReport(running=running), time.monotonic(), True
    return pool


def test_a_decode_pairs_only_with_a_prefill_of_its_weights() -> None:
    async def run() -> None:
        pool = pool_of({"d1": ("decode", V1, 0), "d2": ("decode", V2, 5),
                        "p1": ("prefill", V1, 5), "p2": ("prefill", V2, 0)})
        dispatch = Dispatcher(pool, LoadRouter(local_prefill_threshold=1), Metrics())
        decode, prefill, _ = dispatch._route(JOB, exclude=[])
        assert (decode.address, prefill and prefill.address) == ("d1", "p1")  # not the idler p2
        decode, prefill, _ = dispatch._route(JOB, exclude=["d1"])
        assert (decode.address, prefill and prefill.address) == ("d2", "p2")
        del pool.prefills["p1"]  # no v1 prefill left: d1 prefills itself
        decode, prefill, _ = dispatch._route(JOB, exclude=[])
        assert (decode.address, prefill) == ("d1", None)
        await pool.close()

    asyncio.run(run())


def test_a_migrating_stream_stays_on_its_version() -> None:
    async def run() -> None:
        pool = pool_of({"d1": ("decode", V1, 5), "d2": ("decode", V2, 0), "d3": ("decode", V1, 9)})
        dispatch = Dispatcher(pool, LoadRouter(local_prefill_threshold=1), Metrics())
        v1_key = pool.decodes["d1"].model_key
        assert v1_key is not None and V1 in v1_key
        decode, _, _ = dispatch._route(JOB, exclude=["d1"], model_key=v1_key)
        assert decode.address == "d3"  # busier, but d2 runs other weights
        with pytest.raises(APIError):  # none of its version left: an error, never the other version
            dispatch._route(JOB, exclude=["d1", "d3"], model_key=v1_key)
        assert pool.healthy("decode", exclude=["d1", "d3"], model_key=v1_key) == []
        await pool.close()

    asyncio.run(run())
