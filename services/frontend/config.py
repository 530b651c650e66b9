"""Frontend flags -> one frozen config."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    model: str | None = None  # HF directory or .gguf (for the tokenizer); None: the default model
    served_model_name: str | None = None  # None: the model's own name
    decode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    # Prompts shorter than this many tokens are prefilled on the decode worker itself.
    local_prefill_threshold: int = 64
    # How long startup waits for every worker's Info before serving anyway.
    worker_wait_seconds: float = 120.0
    load_interval_seconds: float = 0.2
    max_body_bytes: int = 16 << 20
    max_n: int = 128
    shutdown_grace_seconds: float = 5.0
    log_level: str = "info"
    # The cluster prefix index: embedded (fed by the workers' load streams) or Redis.
    redis_url: str | None = None
    routing: str = "kv-aware"  # kv-aware | round-robin | random | load
    queue_weight: float = 1.0  # kv-aware: prefill queue cost per block, in blocks of recompute

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("decode: at least one decode worker address (host:port) is needed")
        for address in (*self.decode, *self.prefill):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address {address!r} is not host:port")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold: must be >= 0")
        if self.routing not in ("kv-aware", "round-robin", "random", "load"):
            raise ValueError(f"routing: must be kv-aware, round-robin, random or load, got {self.routing!r}")
        if self.load_interval_seconds <= 0:
            raise ValueError("load_interval: must be > 0")


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.frontend",
                                description="splitserve frontend: OpenAI REST + gRPC, tokenizer, router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST (OpenAI) port")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC Frontend.Generate port")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file, for the tokenizer "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    p.add_argument("--decode", type=_addresses, required=True,
                   help="decode workers: host:port[,host:port...]")
    p.add_argument("--prefill", type=_addresses, default=(), help="prefill workers: host:port[,host:port...]")
    p.add_argument("--local-prefill-threshold", type=int, default=64,
                   help="prompts with fewer tokens are prefilled on the decode worker")
    p.add_argument("--worker-wait", type=float, default=120.0,
                   help="seconds startup waits for the workers to answer Info")
    p.add_argument("--load-interval", type=float, default=0.2, help="WatchLoad report interval, seconds")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20)
    p.add_argument("--max-n", type=int, default=128, help="largest n a request may ask for")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--redis-url", default=None,
                   help="Redis for the cluster prefix index (default: embedded in this process)")
    p.add_argument("--routing", default="kv-aware", choices=["kv-aware", "round-robin", "random", "load"],
                   help="how prefill workers are picked (decode workers: by load)")
    p.add_argument("--queue-weight", type=float, default=1.0,
                   help="kv-aware: cost of one block of queued prefill, in blocks of recompute")
    return p


def parse_config(argv: Sequence[str] | None = None) -> FrontendConfig:
    args = build_parser().parse_args(argv)
    return FrontendConfig(
        host=args.host, port=args.port, grpc_port=args.grpc_port, model=args.model,
        served_model_name=args.served_model_name, decode=tuple(args.decode), prefill=tuple(args.prefill),
        local_prefill_threshold=args.local_prefill_threshold, worker_wait_seconds=args.worker_wait,
        load_interval_seconds=args.load_interval, max_body_bytes=args.max_body_bytes,
        max_n=args.max_n, shutdown_grace_seconds=args.shutdown_grace, log_level=args.log_level,
        redis_url=args.redis_url, routing=args.routing, queue_weight=args.queue_weight)
