"""python -m services.prefill: flags -> config -> engine -> serve."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from protos import pb_grpc
from services.engine_loop import EngineLoop
from services.prefill.servicer import PrefillServicer
from services.worker import (
    WorkerState,
    add_worker_args,
    build_engine,
    numeric_fields,
    serve,
    start_transport,
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitserve prefill")
    add_worker_args(p, "prefill")
    p.add_argument("--fault-send-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    engine = build_engine(args)
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.start()
    transport = await start_transport(engine, args, port=0)
    state = WorkerState("prefill", args.worker_id or f"prefill-{id(engine) % 10000}", loop)
    server = grpc.aio.server()
    servicer = PrefillServicer(state, transport, fault_send_delay=args.fault_send_delay)
    state.extra_counters = lambda: numeric_fields(servicer.stats)
    pb_grpc.add_PrefillServicer_to_server(servicer, server)
    await serve(server, args, state, ["splitserve.v1.Prefill"], [transport.close])


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    asyncio.run(amain(parse(argv)))


if __name__ == "__main__":
    main()
