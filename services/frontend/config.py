"""Frontend flags -> one frozen config."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

from engine.vocab.lora_request import LoRAConfig
from services.cluster_auth import add_cluster_token_arg, cluster_token
from services.frontend.tool_parsers import PARSERS
from services.help_format import DefaultsHelpFormatter, add_host_arg
from services.lora_flags import add_lora_args, lora_config_from_args
from services.sched_policy import add_serving_sched_arg
from services.secret_env import secret_from_env
from services.tracing import add_tracing_args

API_KEY_ENV = "SPLITSERVE_API_KEY"
ROUTING_POLICIES = ("kv-aware", "round-robin", "random", "load")  # how prefill workers are picked


@dataclass(frozen=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    model: str | None = None  # HF directory or .gguf (for the tokenizer); None: the default model
    served_model_name: str | None = None  # None: the model's own name
    # Worker addresses.  Both empty with a redis_url: the workers are discovered
    # through their Redis registrations (services/discovery.py) instead.
    decode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    # Prompts shorter than this many tokens are prefilled on the decode worker itself
    # (kv-aware routing: also prompts with fewer past that worker's cached prefix,
    # where it holds more of them than any prefill worker).
    local_prefill_threshold: int = 64
    # How long startup waits for every worker's Info before serving anyway.
    worker_wait_seconds: float = 120.0
    load_interval_seconds: float = 0.2
    max_body_bytes: int = 4 << 20
    max_n: int = 128
    # What one request may ask for, checked before any work: prompts in one request,
    # choices (prompts x n; admission counts each as a request), and characters per
    # prompt before tokenizing (0: 16 per token of the context, see prepare.py).
    max_prompts: int = 64
    max_choices: int = 256
    max_prompt_chars: int = 0
    shutdown_grace_seconds: float = 5.0
    log_level: str = "info"
    # The cluster prefix index: embedded (fed by the workers' load streams) or Redis.
    redis_url: str | None = None
    routing: str = ROUTING_POLICIES[0]
    queue_weight: float = 1.0  # kv-aware: prefill queue cost per block, in blocks of recompute
    request_cost: float = 2.0  # kv-aware: fixed cost of one queued prefill request, in blocks
    max_migrations: int = 1  # times one stream may resume on another decode worker mid-generation
    # Admission control (0: no limit) and the default deadline of a request (0: none).
    max_waiting_requests: int = 256
    max_waiting_prompt_tokens: int = 0
    max_requests_per_tenant: int = 0
    request_timeout_seconds: float = 600.0
    discovery_interval_seconds: float = 1.0
    otlp_endpoint: str | None = None  # OTLP gRPC collector for traces; None: tracing off
    # The secret every call to a worker carries (services/cluster_auth.py); never printed.
    cluster_token: str | None = field(default=None, repr=False)
    # Clients: bearer keys (none: anyone who reaches the ports may call), TLS on the
    # REST and gRPC ports, and whether tenants (keys) share prefix-cache blocks.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    cache_isolation: str = "none"  # none | tenant
    tool_call_parser: str = "hermes"  # how tool calls are read out of chat output (tool_parsers.PARSERS)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapters served by name
    serving_sched: str = "batch"  # services/sched_policy.py

    def __post_init__(self) -> None:
        if not self.decode and (self.prefill or self.redis_url is None):
            raise ValueError("decode: at least one decode worker address (host:port) is needed, "
                             "or none of either role and a redis_url to discover them")
        for address in (*self.decode, *self.prefill):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"worker address {address!r} is not host:port")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold: must be >= 0")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.max_migrations < 0:
            raise ValueError("max_migrations: must be >= 0")
        for name in ("max_waiting_requests", "max_waiting_prompt_tokens", "max_requests_per_tenant",
                     "request_timeout_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0 (0: no limit)")
        if self.load_interval_seconds <= 0:
            raise ValueError("load_interval: must be > 0")
        if self.discovery_interval_seconds <= 0:
            raise ValueError("discovery_interval: must be > 0")
        for name in ("max_body_bytes", "max_n", "max_prompts", "max_choices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.max_prompt_chars < 0:
            raise ValueError("max_prompt_chars: must be >= 0 (0: 16 per token of the context)")
        check_security(self.api_keys, self.tls_cert, self.tls_key, self.cache_isolation)
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {', '.join(PARSERS)}, "
                             f"got {self.tool_call_parser!r}")

    @property
    def discover_workers(self) -> bool:
        """No worker addresses given: find them in Redis."""
        return not self.decode


def check_security(api_keys: Sequence[str], tls_cert: str | None, tls_key: str | None,
                   cache_isolation: str) -> None:
    """The client-facing trust settings (`splitserve up` checks them before starting anything)."""
    if any(not k or k != k.strip() or "," in k for k in api_keys):
        raise ValueError("api_key: keys must be non-empty, without spaces at either end or commas")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert, tls_key: give both or neither")
    if cache_isolation not in ("none", "tenant"):
        raise ValueError(f"cache_isolation: must be none or tenant, got {cache_isolation!r}")
    if cache_isolation == "tenant" and not api_keys:
        raise ValueError(f"cache_isolation: tenant needs API keys (--api-key or {API_KEY_ENV}): "
                         "tenants are told apart by their key")


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def api_keys(flags: Sequence[str] | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """--api-key (repeatable) and SPLITSERVE_API_KEY (or the file SPLITSERVE_API_KEY_FILE
    names; comma- or line-separated), in that order, once each."""
    keys = [*(flags or ()), *(secret_from_env(API_KEY_ENV, env) or "").replace("\n", ",").split(",")]
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


# The flags' defaults are the config's own: written once, in FrontendConfig.
DEFAULTS = SimpleNamespace(**{f.name: f.default for f in fields(FrontendConfig)})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.frontend", formatter_class=DefaultsHelpFormatter,
                                description="splitserve frontend: OpenAI REST + gRPC, tokenizer, router")
    add_host_arg(p, "the frontend (REST and gRPC)")
    p.add_argument("--port", type=int, default=DEFAULTS.port, help="REST (OpenAI) port")
    p.add_argument("--grpc-port", type=int, default=DEFAULTS.grpc_port, help="gRPC Frontend.Generate port")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file, for the tokenizer "
                        "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    p.add_argument("--decode", type=_addresses, default=(),
                   help="decode workers: host:port[,host:port...] (none: discover them, see --redis-url)")
    p.add_argument("--prefill", type=_addresses, default=(), help="prefill workers: host:port[,host:port...]")
    p.add_argument("--local-prefill-threshold", type=int, default=DEFAULTS.local_prefill_threshold,
                   help="prompts with fewer tokens are prefilled on the decode worker; with kv-aware "
                        "routing, so are prompts with fewer past the decode worker's own cached prefix, "
                        "where it holds more of them than any prefill worker")
    p.add_argument("--worker-wait", type=float, default=DEFAULTS.worker_wait_seconds,
                   help="seconds startup waits for the workers to answer Info")
    p.add_argument("--load-interval", type=float, default=DEFAULTS.load_interval_seconds,
                   help="WatchLoad report interval, seconds")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes,
                   help="largest request body (REST and gRPC)")
    p.add_argument("--max-n", type=int, default=DEFAULTS.max_n, help="largest n a request may ask for")
    p.add_argument("--max-prompts", type=int, default=DEFAULTS.max_prompts,
                   help="most prompts in one /v1/completions request")
    p.add_argument("--max-choices", type=int, default=DEFAULTS.max_choices,
                   help="most choices (prompts x n) in one request; admission counts each as a request")
    p.add_argument("--max-prompt-chars", type=int, default=DEFAULTS.max_prompt_chars,
                   help="longest prompt (or chat messages together) in characters, checked before "
                        "tokenizing (0: 16 x the workers' max_model_len)")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULTS.shutdown_grace_seconds,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    p.add_argument("--log-level", default=DEFAULTS.log_level, choices=["debug", "info", "warning", "error"],
                   help="least severe log line printed")
    p.add_argument("--redis-url", default=None,
                   help="Redis for the cluster prefix index (default: embedded in this process); "
                        "without --decode/--prefill, also where workers register (discovery)")
    p.add_argument("--discovery-interval", type=float, default=DEFAULTS.discovery_interval_seconds,
                   help="seconds between reads of the workers' Redis registrations")
    p.add_argument("--routing", default=DEFAULTS.routing, choices=ROUTING_POLICIES,
                   help="how prefill workers are picked (decode workers: by load)")
    p.add_argument("--queue-weight", type=float, default=DEFAULTS.queue_weight,
                   help="kv-aware: cost of one block of queued prefill, in blocks of recompute")
    p.add_argument("--request-cost", type=float, default=DEFAULTS.request_cost,
                   help="kv-aware: what one queued prefill request costs whatever its cache hit "
                        "(a step, sampling, sending its KV), in blocks of recompute")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULTS.max_waiting_requests,
                   help="requests admitted and still waiting for their first token; past it: 429 "
                        "(0: no limit)")
    p.add_argument("--max-waiting-prompt-tokens", type=int, default=DEFAULTS.max_waiting_prompt_tokens,
                   help="prompt tokens of the waiting requests; past it: 429 (0: no limit)")
    p.add_argument("--max-requests-per-tenant", type=int, default=DEFAULTS.max_requests_per_tenant,
                   help="concurrent requests per API key (or `user` field); past it: 429 (0: no limit)")
    p.add_argument("--request-timeout", type=float, default=DEFAULTS.request_timeout_seconds,
                   help="seconds a request may take in all; past it, it is aborted everywhere (0: none; "
                        "per request: header X-Request-Timeout or a gRPC deadline)")
    add_security_args(p)
    p.add_argument("--max-migrations", type=int, default=DEFAULTS.max_migrations,
                   help="times a stream may resume on another decode worker when its own dies mid-stream "
                        "(0: fail the request instead)")
    add_cluster_token_arg(p)
    p.add_argument("--tool-call-parser", default=DEFAULTS.tool_call_parser, choices=sorted(PARSERS),
                   help="how tool calls are read out of chat output: hermes (<tool_call>{json}</tool_call>, "
                        "Hermes / Qwen) or llama3_json (Llama 3 JSON); default: %(default)s")
    add_lora_args(p)
    add_tracing_args(p)
    add_serving_sched_arg(p)
    return p


def add_security_args(p: argparse.ArgumentParser) -> None:
    """The client-facing trust flags (`splitserve up` takes the same)."""
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"a key clients must send as 'Authorization: Bearer KEY' (repeatable); better "
                        f"{API_KEY_ENV}, comma-separated, which `ps` does not show; none: no authentication")
    p.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve REST and gRPC over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--cache-isolation", default=DEFAULTS.cache_isolation, choices=["none", "tenant"],
                   help="tenant: each API key gets its own prefix-cache namespace (no shared blocks, "
                        "no cached_tokens or timing across keys)")


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> FrontendConfig:
    args = build_parser().parse_args(argv)
    return FrontendConfig(
        host=args.host, port=args.port, grpc_port=args.grpc_port, model=args.model,
        served_model_name=args.served_model_name, decode=tuple(args.decode), prefill=tuple(args.prefill),
        local_prefill_threshold=args.local_prefill_threshold, worker_wait_seconds=args.worker_wait,
        load_interval_seconds=args.load_interval, max_body_bytes=args.max_body_bytes,
        max_n=args.max_n, shutdown_grace_seconds=args.shutdown_grace, log_level=args.log_level,
        redis_url=args.redis_url, routing=args.routing, queue_weight=args.queue_weight,
        max_migrations=args.max_migrations, request_cost=args.request_cost,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_prompt_tokens=args.max_waiting_prompt_tokens,
        max_requests_per_tenant=args.max_requests_per_tenant, request_timeout_seconds=args.request_timeout,
        discovery_interval_seconds=args.discovery_interval, otlp_endpoint=args.otlp_endpoint,
        max_prompts=args.max_prompts, max_choices=args.max_choices, max_prompt_chars=args.max_prompt_chars,
        api_keys=api_keys(args.api_key, os.environ if env is None else env), tls_cert=args.tls_cert,
        tls_key=args.tls_key, cache_isolation=args.cache_isolation, cluster_token=cluster_token(args),
        tool_call_parser=args.tool_call_parser, lora=lora_config_from_args(args),
        serving_sched=args.serving_sched)
