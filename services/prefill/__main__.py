"""python -m services.prefill: flags -> config -> engine -> serve."""

from __future__ import annotations

import argparse

import engine  # noqa: F401 - first: it must set OpenMP's wait policy before torch loads
from protos import pb_grpc
from services.help_format import DefaultsHelpFormatter
from services.peers import KnownDecodeListeners
from services.prefill.servicer import PrefillServicer
from services.worker import add_worker_args, run_worker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve prefill", formatter_class=DefaultsHelpFormatter)
    add_worker_args(p, "prefill")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    run_worker(args, "prefill",
               lambda state, transport, peers, token: PrefillServicer(
                   state, transport,
                   decodes=KnownDecodeListeners(peers, token, state.engine.engine.model_id)),
               pb_grpc.add_PrefillServicer_to_server, "splitserve.v1.Prefill")


if __name__ == "__main__":
    main()
