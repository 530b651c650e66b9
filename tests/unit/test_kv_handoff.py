"""The prefill->decode handoff (engine/kv_handoff.py) and the decode side's
wait for blocks (services/decode/remote_prefill.py): the slice is made in one
place, and a reservation that found the pool short retries when blocks are
freed, not on a timer."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from engine.kv_handoff import KVHandoff
from engine.sampling_params import SamplingParams
from kvtransfer.layout import KVLayout
from protos import pb
from services.decode.remote_prefill import RemotePrefill, ReserveTimeout
from services.decode.stats import DecodeStats
from services.engine_loop import EngineLoop

LAYOUT = KVLayout("m", "float32", "float32", block_size=16, num_layers=1, num_kv_heads=1, head_dim=1)


def test_handoff_sends_only_the_blocks_decode_lacks() -> None:
    h = KVHandoff("r", (7, 3, 9, 4), first_block=2, layout=LAYOUT)
    assert h.blocks_to_fill == (9, 4)
    assert h.pair([10, 11, 12, 13]) == ([12, 13], [9, 4])
    assert KVHandoff("r", (1, 2), 2, LAYOUT).blocks_to_fill == ()  # all of it was a local prefix hit


def test_handoff_refuses_tables_that_do_not_match() -> None:
    with pytest.raises(ValueError, match="dst_block_ids: 4 blocks for a prompt of 3"):
        KVHandoff("r", (7, 3, 9, 4), 1, LAYOUT).pair([1, 2, 3])
    with pytest.raises(ValueError, match="first_block"):
        KVHandoff("r", (7, 3), 3, LAYOUT)
    with pytest.raises(ValueError, match="first_block"):
        KVHandoff("r", (7, 3), -1, LAYOUT)


class ShortPool:
    """The engine's thread-side surface a reservation touches: a pool with
    `free` blocks; a prompt needs `need` of them."""

    def __init__(self, free: int, need: int) -> None:
        self.need = need
        self.attempts = 0
        self.kv: Any = SimpleNamespace(num_free_blocks=free, take_events=lambda: [], block_size=16)

    def reserve_remote(self, request_id: str, prompt: list[int], params: SamplingParams,
                       **kw: Any) -> KVHandoff | None:
        self.attempts += 1
        if self.kv.num_free_blocks < self.need:
            return None
        self.kv.num_free_blocks -= self.need
        return KVHandoff(request_id, tuple(range(self.need)), 0, LAYOUT)

    def free(self, n: int) -> None:
        self.kv.num_free_blocks += n

    def has_unfinished(self) -> bool:
        return False


def remote_prefill(loop: EngineLoop, reserve_timeout: float) -> RemotePrefill:
    state: Any = SimpleNamespace(engine=loop)
    return RemotePrefill(state, transport=None, stats=DecodeStats(),  # type: ignore[arg-type]
                         prefill_stub=lambda address: None,  # type: ignore[arg-type,return-value]
                         failure_policy="recompute", transfer_timeout=1.0, reserve_timeout=reserve_timeout)


async def waiting_reservation(loop: EngineLoop) -> asyncio.Future[KVHandoff]:
    """A reservation of 4 blocks, once it found the pool short and waits."""
    rp = remote_prefill(loop, reserve_timeout=60)
    task = asyncio.ensure_future(rp._reserve("r", [1] * 60, SamplingParams(), pb.WorkerGenerateRequest()))
    while rp.stats.waits_for_blocks == 0:
        await asyncio.sleep(0.01)
    return task


def test_a_short_pool_retries_when_blocks_are_freed_not_on_a_timer() -> None:
    async def run() -> tuple[KVHandoff, int, int]:
        engine = ShortPool(free=2, need=4)
        loop = EngineLoop(engine, asyncio.get_running_loop())  # type: ignore[arg-type]
        loop.start()
        try:
            task = await waiting_reservation(loop)
            await asyncio.sleep(0.5)  # a poller would have tried ~25 times by now
            attempts_while_short = engine.attempts
            await loop.call(lambda e: e.free(2))  # type: ignore[attr-defined]
            handoff = await asyncio.wait_for(task, timeout=10)
            return handoff, attempts_while_short, engine.attempts
        finally:
            loop.stop()

    handoff, attempts_while_short, attempts = asyncio.run(run())
    assert handoff.block_ids == (0, 1, 2, 3)
    assert attempts_while_short == 1  # it waited on the event, not a timer
    assert attempts == 2  # one retry: after the blocks were freed


def test_a_pool_that_stays_short_times_out() -> None:
    async def run() -> float:
        engine = ShortPool(free=2, need=4)
        loop = EngineLoop(engine, asyncio.get_running_loop())  # type: ignore[arg-type]
        loop.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(ReserveTimeout, match="no KV blocks free"):
                await remote_prefill(loop, reserve_timeout=0.3)._reserve(
                    "r", [1] * 60, SamplingParams(), pb.WorkerGenerateRequest())
            return time.monotonic() - t0
        finally:
            loop.stop()

    assert 0.3 <= asyncio.run(run()) < 10


def test_a_reservation_waiting_for_blocks_learns_of_the_engines_death_at_once() -> None:
    from services.engine_loop import EngineDead
    from services.fault_hooks import FaultHooks

    async def run() -> float:
        engine = ShortPool(free=2, need=4)
        crash = asyncio.Event()  # set on the loop; read by the engine thread's hook

        def die() -> None:
            if crash.is_set():
                raise RuntimeError("injected engine-thread fault")

        loop = EngineLoop(engine, asyncio.get_running_loop(),  # type: ignore[arg-type]
                          faults=FaultHooks(engine_iteration=die))
        loop.start()
        try:
            task = await waiting_reservation(loop)
            t0 = time.monotonic()
            crash.set()
            with pytest.raises(EngineDead):
                await asyncio.wait_for(task, timeout=30)
            return time.monotonic() - t0
        finally:
            loop.stop()

    assert asyncio.run(run()) < 10  # not the 60 s reserve timeout
