"""`splitserve up`: the whole stack on one machine.  Starts N prefill and M
decode workers, then the frontend, waits until all are healthy, prints the
endpoints, then supervises them (services/supervisor.py: a process that dies
is restarted on the same ports; a crash loop stops the stack), and stops
everything cleanly on Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from services.affinity import format_cpu_list, plan_affinity, usable_cpus
from services.cluster_auth import ENV as CLUSTER_TOKEN_ENV
from services.cluster_auth import add_cluster_token_arg, cluster_token, new_token
from services.frontend.config import (
    API_KEY_ENV,
    ROUTING_POLICIES,
    add_security_args,
    api_keys,
    check_security,
)
from services.frontend.config import DEFAULTS as FRONTEND_DEFAULTS
from services.help_format import add_host_arg, given_argv
from services.lora_flags import add_lora_args, lora_argv, lora_config_from_args
from services.ports import free_port
from services.speculative_flags import add_speculative_args, speculative_argv, speculative_config_from_args
from services.supervisor import CrashLoop, RestartPolicy, Supervisor, own_tls
from services.tracing import add_tracing_args
from services.worker_flags import (
    DEFAULT_KV_TRANSFER_TIMEOUT_S,
    DEFAULT_LOCAL_PREFILL_THRESHOLD,
    KV_FAILURE_POLICIES,
)

ENGINE_FLAGS = ("model", "dtype", "device", "block_size", "kv_cache_memory", "kv_cache_dtype",
                "prefill_dtype", "decode_dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "scheduling_policy", "seed", "num_blocks")


def engine_argv(args: argparse.Namespace) -> list[str]:
    return given_argv(args, ENGINE_FLAGS, switches=("no_prefix_caching",))


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                               start_timeout_s=args.start_timeout)
        self.supervisor = Supervisor(policy)
        self.tmp = Path(tempfile.mkdtemp(prefix="splitserve-"))
        # One secret per stack, in the children's environment (argv is world-readable in ps).
        self.env = {**os.environ, CLUSTER_TOKEN_ENV: cluster_token(args) or new_token()}

    def _spawn(self, name: str, argv: list[str], ready_file: Path | None = None,
               health_url: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self.supervisor.spawn(name, [sys.executable, "-m", *argv], ready_file, health_url,
                                     env=self.env if env is None else {**self.env, **env})

    def _wait_ready(self, name: str, proc: subprocess.Popen[bytes], ready: Path, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
            if ready.exists():
                return ready.read_text().strip()
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready after {timeout:.0f} s")

    def start(self) -> dict[str, list[str]]:
        a = self.args
        n_workers = a.prefill + a.decode
        threads = a.num_threads or max(1, (os.cpu_count() or 2) // n_workers)
        pinning = plan_affinity(a.cpu_affinity, a.prefill, a.decode, usable_cpus())
        if pinning:
            print("splitserve: pinning " + ", ".join(f"{name} to cpus {format_cpu_list(cpus)}"
                                                    for name, cpus in pinning.items()), flush=True)
        common = [*engine_argv(a), *lora_argv(a), "--host", a.host]
        if a.otlp_endpoint:
            common += ["--otlp-endpoint", a.otlp_endpoint]
        pending = []
        # Each worker's gRPC port is chosen here, so the frontend starts alongside
        # the workers (its start-up overlaps theirs) and connects as they come up.
        addrs: dict[str, list[str]] = {role: [f"{a.host}:{free_port(a.host)}" for _ in range(count)]
                                       for role, count in (("prefill", a.prefill), ("decode", a.decode))}
        for role, count in (("prefill", a.prefill), ("decode", a.decode)):
            peer_role = "decode" if role == "prefill" else "prefill"
            for i in range(count):
                name = f"{role}-{i}"
                ready = self.tmp / f"{name}.addr"
                port = int(addrs[role][i].rpartition(":")[2])
                # Each worker knows its peers (and contacts no address a caller names).
                peers = ["--" + peer_role, ",".join(addrs[peer_role])] if addrs[peer_role] else []
                argv = [f"services.{role}", *common, *peers, "--worker-id", name, "--ready-file", str(ready),
                        "--grpc-port", str(port), "--kv-transfer-timeout", str(a.kv_transfer_timeout)]
                cpus = pinning.get(name)
                argv += ["--num-threads", str(a.num_threads or (len(cpus) if cpus else threads))]
                if cpus:
                    argv += ["--cpus", format_cpu_list(cpus)]
                if role == "decode":
                    argv += ["--local-prefill-threshold", str(a.local_prefill_threshold),
                             "--kv-failure-policy", a.kv_failure_policy, *speculative_argv(a)]
                pending.append((name, self._spawn(name, argv, ready_file=ready), ready))
        argv = ["services.frontend", "--host", a.host, "--port", str(a.port), "--grpc-port", str(a.grpc_port),
                "--decode", ",".join(addrs["decode"]),
                "--local-prefill-threshold", str(a.local_prefill_threshold), "--routing", a.routing]
        if addrs["prefill"]:
            argv += ["--prefill", ",".join(addrs["prefill"])]
        if a.model:
            argv += ["--model", a.model]
        if a.redis_url:
            argv += ["--redis-url", a.redis_url]
        if a.otlp_endpoint:
            argv += ["--otlp-endpoint", a.otlp_endpoint]
        argv += frontend_security_argv(a) + lora_argv(a) + frontend_passthrough_argv(a)
        health_url = f"{rest_scheme(a)}://{a.host}:{a.port}/health"
        frontend = self._spawn("frontend", argv, health_url=health_url, env=frontend_env(a, os.environ))
        for name, proc, ready in pending:
            self._wait_ready(name, proc, ready, a.start_timeout)
        self._wait_http(frontend, health_url, a.start_timeout, a.prefill)
        return addrs

    def _wait_http(self, proc: subprocess.Popen[bytes], url: str, timeout: float, prefill: int) -> None:
        """Until the frontend is healthy and sees every prefill worker."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"frontend exited with {proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(url, timeout=1, context=own_tls()) as r:
                    if r.status == 200 and json.load(r).get("healthy_prefill_workers", 0) >= prefill:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"frontend not healthy at {url} after {timeout:.0f} s")

    def stop(self) -> None:
        self.supervisor.stop()

    def wait(self) -> int:
        """Supervise until a signal arrives (0) or a process keeps dying (1)."""
        stop = {"sig": 0}

        def on_signal(signum: int, _frame: object) -> None:
            stop["sig"] = signum

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stop["sig"]:
            try:
                self.supervisor.check()
            except CrashLoop as e:
                print(f"splitserve: {e}", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0


def rest_scheme(args: argparse.Namespace) -> str:
    return "https" if args.tls_cert else "http"


def frontend_security_argv(args: argparse.Namespace) -> list[str]:
    out = ["--cache-isolation", args.cache_isolation]
    if args.tls_cert:
        out += ["--tls-cert", args.tls_cert]
    if args.tls_key:
        out += ["--tls-key", args.tls_key]
    return out


def frontend_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The frontend's environment: the API keys travel here, not in argv, where
    `ps` would show them to every user of the machine."""
    return {**environ, API_KEY_ENV: ",".join(api_keys(args.api_key, environ))}


def add_up_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stack")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers")
    g.add_argument("--decode", type=int, default=1, help="decode workers")
    add_host_arg(g, "every service")
    g.add_argument("--port", type=int, default=FRONTEND_DEFAULTS.port, help="REST (OpenAI) port")
    g.add_argument("--grpc-port", type=int, default=FRONTEND_DEFAULTS.grpc_port,
                   help="the frontend's gRPC port")
    g.add_argument("--redis-url", default=None, help="Redis for the prefix index (default: embedded)")
    g.add_argument("--routing", default=FRONTEND_DEFAULTS.routing, choices=ROUTING_POLICIES,
                   help="how the frontend picks workers (kv-aware: where the prompt's prefix is cached)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    g.add_argument("--local-prefill-threshold", type=int, default=DEFAULT_LOCAL_PREFILL_THRESHOLD,
                   help="prompts with fewer tokens are prefilled on the decode worker")
    g.add_argument("--kv-failure-policy", choices=KV_FAILURE_POLICIES, default=KV_FAILURE_POLICIES[0],
                   help="a failed KV transfer: recompute the prompt on the decode worker, or fail it")
    g.add_argument("--kv-transfer-timeout", type=float, default=DEFAULT_KV_TRANSFER_TIMEOUT_S,
                   help="seconds per KV transfer")
    g.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds each process may take to become ready (a first start compiles kernels)")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="a process that dies is restarted (back-off 0.5 s, doubling to 30 s); one that "
                        "dies more often than this within --restart-window stops the stack (crash loop)")
    g.add_argument("--restart-window", type=float, default=60.0, help="seconds; see --max-restarts")
    g.add_argument("--cpu-affinity", default="auto",
                   help="pin workers to cores: auto (each worker its own cores when there are enough; "
                        "under 2 a worker, decode workers share the prefill cores: 1 prefill + 1 decode "
                        "on 2 cores: cpu 0, and cpus 0-1), off, or e.g. "
                        "'prefill=0-3;decode=4-15' (split among each role's workers)")
    add_cluster_token_arg(g)
    add_speculative_args(p)
    add_lora_args(p)
    add_tracing_args(p)
    add_security_args(p)
    add_frontend_passthrough(p)


PASSTHROUGH = "frontend__"  # dest prefix of the frontend's own flags on `up`


def add_frontend_passthrough(p: argparse.ArgumentParser) -> None:
    """Every `splitserve frontend` flag that `up` does not define itself, with
    the frontend's help, handed to the frontend when given (so the stack takes
    what the README says the frontend does: --request-timeout, --max-migrations...)."""
    from services.frontend.config import build_parser as frontend_parser

    g = p.add_argument_group("frontend (handed to it as given; defaults are the frontend's)")
    for action in frontend_parser()._actions:
        if not action.option_strings or any(o in p._option_string_actions for o in action.option_strings):
            continue
        act = copy.copy(action)
        act.dest, act.default = PASSTHROUGH + action.dest, None
        act.metavar = action.metavar or (None if action.choices else action.dest.upper())
        if "default" not in (action.help or ""):
            act.help = f"{action.help or ''} (default: {action.default})".lstrip()
        g._add_action(act)


def frontend_passthrough_argv(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    from services.frontend.config import build_parser as frontend_parser

    for action in frontend_parser()._actions:
        value = getattr(args, PASSTHROUGH + action.dest, None)
        if value is not None:
            out += [action.option_strings[-1], str(value)]
    return out


def cmd_up(args: argparse.Namespace) -> int:
    if args.decode < 1 or args.prefill < 0:
        print("splitserve: --decode must be >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    if args.max_restarts < 0 or args.restart_window <= 0:
        print("splitserve: --max-restarts must be >= 0 and --restart-window > 0", file=sys.stderr)
        return 2
    try:
        speculative_config_from_args(args)  # fail before starting anything
        lora_config_from_args(args)
        check_security(api_keys(args.api_key, os.environ), args.tls_cert, args.tls_key, args.cache_isolation)
    except ValueError as e:
        print(f"splitserve: {e}", file=sys.stderr)
        return 2
    stack = Stack(args)
    try:
        addrs = stack.start()
        print(f"splitserve is up: REST {rest_scheme(args)}://{args.host}:{args.port}/v1  "
              f"gRPC {args.host}:{args.grpc_port}\n"
              f"  prefill workers: {', '.join(addrs['prefill']) or '-'}\n"
              f"  decode workers:  {', '.join(addrs['decode'])}\n"
              f"  cluster: {rest_scheme(args)}://{args.host}:{args.port}/cluster   metrics: /metrics   "
              "Ctrl-C stops",
              flush=True)
        return stack.wait()
    except RuntimeError as e:
        print(f"splitserve: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
