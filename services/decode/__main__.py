"""python -m services.decode: flags -> config -> engine -> serve."""

from __future__ import annotations

import argparse

import engine  # noqa: F401 - first: it must set OpenMP's wait policy before torch loads
from protos import pb_grpc
from services.decode.servicer import DecodeServicer
from services.help_format import DefaultsHelpFormatter
from services.worker import add_worker_args, run_worker
from services.worker_flags import add_decode_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve decode", formatter_class=DefaultsHelpFormatter)
    add_worker_args(p, "decode")
    add_decode_args(p)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    run_worker(args, "decode",
               lambda state, transport, peers, token: DecodeServicer(
                   state, transport, local_prefill_threshold=args.local_prefill_threshold,
                   failure_policy=args.kv_failure_policy, transfer_timeout=args.kv_transfer_timeout,
                   prefills=peers, cluster_token=token),
               pb_grpc.add_DecodeServicer_to_server, "splitserve.v1.Decode")


if __name__ == "__main__":
    main()
