"""Every flag of the prefill and decode workers, and the one mapping from flags
to EngineConfig.  The engine flags are shared with `splitserve up`, `chat`,
`generate` and `bench offline`.  Defaults are the config dataclasses' own
(engine/config.py), so they are written once.  Torch-free: the launcher parses
these without loading the engine."""

from __future__ import annotations

import argparse
import logging
import socket
from typing import Any

from engine.config import (
    DECODE_DTYPES,
    DTYPES,
    KV_CACHE_DTYPES,
    PREFILL_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    engine_config,
)
from services.cluster_auth import add_cluster_token_arg
from services.help_format import add_host_arg
from services.lora_flags import add_lora_args, lora_kwargs
from services.sched_policy import add_serving_sched_arg
from services.speculative_flags import add_speculative_args, speculative_config_from_args
from services.tracing import add_tracing_args

# Also the defaults of `splitserve up`'s copies of these flags.
log = logging.getLogger(__name__)

DEFAULT_KV_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_LOCAL_PREFILL_THRESHOLD = 64
# A prefill worker's steps hold prompts only, and each prompt's first token
# waits for its whole step: smaller steps than an engine's default (2048)
# finish the first prompts sooner at the same rate (Zen 5, split, mixed
# workload: TTFT p50 1.0-1.6 s against 3.7-4.1 s, 250-285 tok/s against 235-251).
PREFILL_WORKER_MAX_NUM_BATCHED_TOKENS = 512
KV_FAILURE_POLICIES = ("recompute", "fail")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=ModelConfig.dtype, choices=DTYPES,
                   help="auto: bfloat16 on GPUs, float32 on CPUs (the packed kernels; bfloat16 where "
                        "they are missing and the CPU has native bf16); bfloat16 on a CPU with "
                        "AVX512-BF16 or AMX: the weights as bfloat16 panels on the packed kernels, "
                        "activations float32")
    g.add_argument("--device", default=ModelConfig.device,
                   help="cpu, cuda, cuda:N, or auto (cuda when there is a GPU)")
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", type=float, default=CacheConfig.kv_cache_memory,
                   help="KV budget: a fraction of free memory (<= 1) or bytes (> 1)")
    g.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model's dtype); bfloat16 or float16, half a float32 "
                        "model's cache (float16: 3 more bits, a narrower range); or fp8, half a "
                        "bfloat16 cache (twice the blocks, half the bytes sent to "
                        "decode and read each step); prefill and decode must agree")
    g.add_argument("--prefill-dtype", default=ModelConfig.prefill_dtype, choices=PREFILL_DTYPES,
                   help="auto: prompts in --dtype; bfloat16: a float32 model's prompt tokens through "
                        "bfloat16 projections (CPUs with AVX512-BF16; about twice as fast), generated "
                        "tokens stay exact; prefill and decode must agree")
    g.add_argument("--decode-dtype", default=ModelConfig.decode_dtype, choices=DECODE_DTYPES,
                   help="auto: generated tokens in --dtype; 4-bit float32 models: int8 (inputs "
                        "int8 per block of 32) or bfloat16 (inputs "
                        "rounded, AVX512-BF16 and VBMI); any float32 model: bfloat16-weights "
                        "(bfloat16 panels, AMX tiles where present); a bfloat16 model: either bfloat16 "
                        "option (auto picks); prompt tokens keep their path")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context)")
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                   help="most tokens in one engine step (longer prompts are prefilled in chunks); "
                        f"default {SchedulerConfig.max_num_batched_tokens}, a prefill worker's "
                        f"{PREFILL_WORKER_MAX_NUM_BATCHED_TOKENS}")
    g.add_argument("--scheduling-policy", default=SchedulerConfig.policy, choices=["fcfs", "priority"],
                   help="fcfs: first come first served; priority: lower `priority` first, preempting")
    g.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached prompt blocks")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--seed", type=int, default=ModelConfig.seed, help="seed of requests that bring none")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as `LLM(...)` / `engine_config(...)` keywords."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                prefill_dtype=args.prefill_dtype, decode_dtype=args.decode_dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                scheduling_policy=args.scheduling_policy,
                enable_prefix_caching=not args.no_prefix_caching,
                num_threads=args.num_threads, seed=args.seed)


def worker_engine_config(args: argparse.Namespace) -> EngineConfig:
    """A worker's flags -> its engine's config.  Raises ValueError naming the field."""
    return engine_config(**engine_kwargs(args), num_blocks=args.num_blocks,
                         speculative_config=speculative_config_from_args(args),
                         **lora_kwargs(args))


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    add_engine_args(p)
    g = p.add_argument_group("worker")
    add_host_arg(g, "the worker (gRPC and UCX)")
    g.add_argument("--grpc-port", type=int, default=0, help="0: pick a free port")
    g.add_argument("--ucx-port", type=int, default=0, help="UCX listener port (0: pick a free port)")
    add_serving_sched_arg(g)
    g.add_argument("--worker-id", default=None,
                   help="name in logs, metrics and /cluster (default: role-host-pid)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-transfer-timeout", type=float, default=DEFAULT_KV_TRANSFER_TIMEOUT_S,
                   help="seconds per KV transfer")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port (0: pick a free port)")
    g.add_argument("--ready-file", default=None, help="write 'grpc_address' here once serving")
    if role == "decode":
        add_speculative_args(p)
    else:
        p.set_defaults(max_num_batched_tokens=PREFILL_WORKER_MAX_NUM_BATCHED_TOKENS)
    g.add_argument("--advertise-host", default=None,
                   help="the host others reach this worker at (gRPC and UCX); default: --host, or this "
                        "machine's address when --host is 0.0.0.0 (containers)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds to finish the requests in flight before the rest are cut "
                        "(the frontend resumes cut streams on another worker)")
    g.add_argument("--redis-url", default=None,
                   help="register this worker's address here, for frontends that discover workers")
    g.add_argument("--cpus", default=None,
                   help="pin this worker to these cores, e.g. 0-3,6 (torch threads default to their count)")
    add_cluster_token_arg(g)
    peers = peer_role(role)
    g.add_argument(f"--{peers}", type=peer_addresses, default=(),
                   help=f"the {peers} workers this worker may contact (gRPC host:port[,...]); with "
                        f"--redis-url also those registered there; no other address a caller names")
    add_lora_args(p)
    add_tracing_args(p)


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """The decode worker's own flags, after add_worker_args(p, "decode")."""
    p.add_argument("--local-prefill-threshold", type=int, default=DEFAULT_LOCAL_PREFILL_THRESHOLD,
                   help="prompts with fewer tokens than this are prefilled here")
    p.add_argument("--kv-failure-policy", choices=KV_FAILURE_POLICIES, default=KV_FAILURE_POLICIES[0],
                   help="a failed KV transfer: recompute the prompt here, or fail the request")


def peer_role(role: str) -> str:
    """The role a worker of `role` talks to."""
    return "prefill" if role == "decode" else "decode"


def peer_addresses(value: str) -> tuple[str, ...]:
    out = tuple(a.strip() for a in value.split(",") if a.strip())
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"peer address {a!r} is not host:port")
    return out


def advertise_host(args: argparse.Namespace) -> str:
    """The host peers reach this worker at (gRPC and UCX)."""
    if args.advertise_host:
        return str(args.advertise_host)
    if args.host in ("0.0.0.0", "::", ""):
        try:  # a container's name resolves to its address on the compose network
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            log.warning("cannot resolve this host's name; advertising 127.0.0.1 (set --advertise-host)")
            return "127.0.0.1"
    return str(args.host)
