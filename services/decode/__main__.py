"""python -m services.decode: flags -> config -> engine -> serve."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from protos import pb_grpc
from services.decode.servicer import DecodeServicer
from services.engine_loop import EngineLoop
from services.worker import (
    WorkerState,
    add_worker_args,
    build_engine,
    numeric_fields,
    serve,
    start_transport,
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitserve decode")
    add_worker_args(p, "decode")
    p.add_argument("--local-prefill-threshold", type=int, default=64,
                   help="prompts with fewer tokens than this are prefilled here")
    p.add_argument("--kv-failure-policy", choices=["recompute", "fail"], default="recompute")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    engine = build_engine(args)
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.start()
    transport = await start_transport(engine, args, port=args.ucx_port)
    state = WorkerState("decode", args.worker_id or f"decode-{id(engine) % 10000}", loop,
                        ucx_address=transport.address)
    server = grpc.aio.server()
    servicer = DecodeServicer(state, transport, local_prefill_threshold=args.local_prefill_threshold,
                              failure_policy=args.kv_failure_policy,
                              transfer_timeout=args.kv_transfer_timeout)
    state.extra_counters = lambda: numeric_fields(servicer.stats)
    pb_grpc.add_DecodeServicer_to_server(servicer, server)
    await serve(server, args, state, ["splitserve.v1.Decode"], [servicer.close, transport.close])


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    asyncio.run(amain(parse(argv)))


if __name__ == "__main__":
    main()
