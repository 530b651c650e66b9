"""python -m services.decode: flags -> config -> engine -> serve."""

from __future__ import annotations

import argparse

from protos import pb_grpc
from services.decode.servicer import DecodeServicer
from services.help_format import DefaultsHelpFormatter
from services.worker import add_worker_args, run_worker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve decode", formatter_class=DefaultsHelpFormatter)
    add_worker_args(p, "decode")
    p.add_argument("--local-prefill-threshold", type=int, default=64,
                   help="prompts with fewer tokens than this are prefilled here")
    p.add_argument("--kv-failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="a failed KV transfer: recompute the prompt here, or fail the request")
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
