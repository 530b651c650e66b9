"""What prefill and decode workers share: flags, engine construction, the
Info / WatchLoad / Abort RPCs, and serving with health and reflection."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.block_pool import CacheEvent
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from protos import pb
from services.cluster_auth import add_cluster_token_arg, cluster_token, server_interceptors, warn_if_open
from services.discovery import LAYOUT_FIELDS
from services.engine_loop import EngineDead, EngineLoop
from services.peers import KnownPeers
from services.speculative_flags import add_speculative_args, speculative_config_from_args
from services.tracing import Tracing, add_tracing_args

if TYPE_CHECKING:
    from services.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    from services.cli import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("worker")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--grpc-port", type=int, default=0, help="0: pick a free port")
    g.add_argument("--ucx-port", type=int, default=0, help="UCX listener port (0: pick a free port)")
    g.add_argument("--worker-id", default=None,
                   help="name in logs, metrics and /cluster (default: role-host-pid)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds per KV transfer")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port (0: pick a free port)")
    g.add_argument("--ready-file", default=None, help="write 'grpc_address' here once serving")
    if role == "decode":
        add_speculative_args(p)
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
    peers = "prefill" if role == "decode" else "decode"
    g.add_argument(f"--{peers}", type=peer_addresses, default=(),
                   help=f"the {peers} workers this worker may contact (gRPC host:port[,...]); with "
                        f"--redis-url also those registered there; no other address a caller names")
    # Test-only fault hooks (services/engine_loop.py); nothing happens unless the file appears.
    g.add_argument("--fault-engine-crash-file", default=None, help=argparse.SUPPRESS)
    g.add_argument("--fault-step-fail-file", default=None, help=argparse.SUPPRESS)
    add_tracing_args(p)


def peer_addresses(value: str) -> tuple[str, ...]:
    out = tuple(a.strip() for a in value.split(",") if a.strip())
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"peer address {a!r} is not host:port")
    return out


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return str(args.advertise_host)
    if args.host in ("0.0.0.0", "::", ""):
        try:  # a container's name resolves to its address on the compose network
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            log.warning("cannot resolve this host's name; advertising 127.0.0.1 (set --advertise-host)")
            return "127.0.0.1"
    return str(args.host)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError naming the field."""
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                          num_threads=args.num_threads),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching, num_blocks=args.num_blocks,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len or 1 << 30,
                                  policy=args.scheduling_policy),
        speculative=speculative_config_from_args(args))


def build_engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(engine_config(args))


async def start_transport(engine: LLMEngine, args: argparse.Namespace, port: int):  # type: ignore[no-untyped-def]
    """The UCX listener over this worker's KV cache memory."""
    from kvtransfer.layout import KVLayout
    from kvtransfer.transport import KVTransport

    kv = engine.runner.kv_cache
    transport = KVTransport(kv, KVLayout.from_cache(kv, engine.model_id), host=advertise_host(args),
                            port=port, timeout_s=args.kv_transfer_timeout)
    await transport.start()
    return transport


def numeric_fields(stats: object) -> dict[str, float]:
    """A stats dataclass's numeric fields as counters."""
    return {k: float(v) for k, v in asdict(stats).items() if isinstance(v, (int, float))}  # type: ignore[call-overload]


def layout_dict(engine: LLMEngine) -> dict[str, Any]:
    """The layout a registration carries and a peer's must equal (invariant 7)."""
    p = layout_proto(engine)
    return {f: getattr(p, f) for f in LAYOUT_FIELDS}


def layout_proto(engine: LLMEngine) -> pb.KVLayout:
    s = engine.runner.spec
    return pb.KVLayout(model_id=engine.model_id, dtype=str(engine.runner.dtype).removeprefix("torch."),
                       kv_cache_dtype=str(engine.runner.kv_dtype).removeprefix("torch."),
                       block_size=engine.kv.block_size, num_layers=s.num_layers,
                       num_kv_heads=s.num_kv_heads, head_dim=s.head_dim)


class CacheEventLog:
    """Prefix-cache events in order, on the asyncio loop; each WatchLoad stream
    reads from its own cursor.  Bounded: a stream that falls behind the trimmed
    head gets a fresh snapshot instead."""

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._events: list[CacheEvent] = []
        self._base = 0  # sequence number of _events[0]

    @property
    def end(self) -> int:
        return self._base + len(self._events)

    def append(self, events: list[CacheEvent]) -> None:
        self._events.extend(events)
        if len(self._events) > self.limit:
            drop = len(self._events) - self.limit // 2
            del self._events[:drop]
            self._base += drop

    def since(self, cursor: int) -> list[CacheEvent] | None:
        """Events from `cursor` on; None when they were trimmed away."""
        if cursor < self._base:
            return None
        return self._events[cursor - self._base:]


def cache_events_proto(events: list[CacheEvent]) -> list[pb.CacheEvent]:
    return [pb.CacheEvent(kind=e.kind, block_hashes=e.block_hashes, parent=e.parent or b"")
            for e in events]


@dataclass
class WorkerState:
    role: str
    worker_id: str
    engine: EngineLoop
    grpc_address: str = ""
    ucx_address: str = ""
    metrics_url: str = ""
    extra_counters: Callable[[], dict[str, float]] | None = None
    cache_events: CacheEventLog = field(default_factory=CacheEventLog)
    tracing: Tracing = field(default_factory=Tracing.off)
    metrics: WorkerMetrics | None = None  # Prometheus; set up before serving
    draining: bool = False  # SIGTERM: finish what is here, take nothing new
    transport: Any = None  # the KVTransport, for its pending transfers

    def load(self) -> pb.LoadReport:
        eng = self.engine.engine
        sched = eng.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in list(sched.requests.values()))
        counters = {"prompt_tokens_computed": float(eng.prompt_tokens_computed),
                    "generation_tokens": float(eng.generation_tokens),
                    "num_preemptions": float(sched.num_preemptions),
                    "prefix_cache_queries": float(eng.kv.prefix_queries),
                    "prefix_cache_hits": float(eng.kv.prefix_hits)}
        counters.update(spec_decode_counters(eng))
        if self.extra_counters is not None:
            counters.update(self.extra_counters())
        return pb.LoadReport(worker_id=self.worker_id, role=self.role, running=sched.num_running,
                             waiting=sched.num_waiting, free_blocks=eng.kv.num_free_blocks,
                             total_blocks=eng.kv.num_blocks, queued_prompt_tokens=queued,
                             counters=counters, draining=self.draining,
                             kv_transfers_pending=self.transport.num_pending if self.transport else 0)

    def info(self) -> pb.WorkerInfo:
        eng = self.engine.engine
        return pb.WorkerInfo(worker_id=self.worker_id, role=self.role, pid=os.getpid(),
                             grpc_address=self.grpc_address, ucx_address=self.ucx_address,
                             metrics_url=self.metrics_url, model_id=eng.model_id,
                             layout=layout_proto(eng), max_model_len=eng.max_model_len)


def spec_decode_counters(engine: LLMEngine) -> dict[str, float]:
    stats = engine.spec.stats if engine.spec is not None else None
    return {"spec_decode_num_drafts": float(stats.num_drafts if stats else 0),
            "spec_decode_num_draft_tokens": float(stats.num_draft_tokens if stats else 0),
            "spec_decode_num_accepted_tokens": float(stats.num_accepted_tokens if stats else 0)}


def start_metrics(state: WorkerState, host: str, port: int) -> str:
    from services.worker_metrics import WorkerMetrics, start_metrics_server

    if state.metrics is None:
        state.metrics = WorkerMetrics(state)
    return start_metrics_server(state.metrics, host, port)


class WorkerRPCs:
    """Info, WatchLoad and Abort: the same on both roles."""

    state: WorkerState

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        return self.state.info()

    async def WatchLoad(self, request: pb.LoadRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LoadReport]:
        interval = min(max(request.interval_seconds or 0.5, 0.05), 10.0)
        log_ = self.state.cache_events
        pending: list[CacheEvent] | None = None
        cursor = 0
        while True:
            if pending is None:  # first report, or fell behind: a snapshot
                hashes = await self.state.engine.call(lambda e: e.kv.pool.cached_hashes())
                cursor = log_.end  # events logged after this are newer than the snapshot
                pending = [CacheEvent("cleared"), CacheEvent("stored", hashes)]
            report = self.state.load()
            report.cache_events.extend(cache_events_proto(pending))
            yield report
            await asyncio.sleep(interval)
            pending = log_.since(cursor)
            cursor = log_.end

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id
        await self.before_free(rid)  # its KV transfer first: no write may land in freed blocks
        found = await self.state.engine.call(lambda e: e.abort(rid))
        self.state.engine.fail_stream(rid, RequestAborted(f"request {rid!r} was aborted"))
        return pb.AbortResponse(found=found)

    async def before_free(self, request_id: str) -> None:
        """Stop the request's KV transfer, if any, before its blocks are freed."""

    async def close(self) -> None:
        pass


class RequestAborted(Exception):
    """An Abort RPC ended the request; its stream answers CANCELLED."""


async def abort_with(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """End an RPC whose stream got `err` instead of an output, with the status that says
    what a caller may do: UNAVAILABLE (engine dead: retry elsewhere), CANCELLED, INTERNAL."""
    if isinstance(err, EngineDead):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker: {err}; use another")
    if isinstance(err, RequestAborted):
        await context.abort(grpc.StatusCode.CANCELLED, str(err))
    await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {err}")


def pin_worker(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """Pins the process to --cpus before the engine starts its threads; the
    flags with --num-threads defaulted to the number of those cores."""
    from services.affinity import parse_cpu_list, pin_process

    try:
        cpus = parse_cpu_list(args.cpus)
        pin_process(cpus)
    except (ValueError, OSError) as e:
        raise SystemExit(f"splitserve {role}: --cpus {args.cpus}: {e}") from None
    log.info("pinned to cpus %s", args.cpus)
    return argparse.Namespace(**{**vars(args), "num_threads": args.num_threads or len(cpus)})


def run_worker(args: argparse.Namespace, role: str,
               make_servicer: Callable[[WorkerState, Any, KnownPeers, str | None], Any],
               add_to_server: Callable[[Any, grpc.aio.Server], None], service_name: str) -> None:
    """flags -> config -> engine (own thread) -> UCX transport -> gRPC server, until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    if args.cpus:
        args = pin_worker(args, role)
    try:
        engine_config(args)  # bad configuration fails here, before anything starts
    except ValueError as e:
        raise SystemExit(f"splitserve {role}: {e}") from None

    token = cluster_token(args)
    warn_if_open(token, args.host, f"splitserve {role}")
    peer_role = "prefill" if role == "decode" else "decode"

    async def amain() -> int:
        engine = build_engine(args)
        loop = EngineLoop(engine, asyncio.get_running_loop(), crash_file=args.fault_engine_crash_file,
                          step_fail_file=args.fault_step_fail_file)
        loop.start()
        transport = await start_transport(engine, args, port=args.ucx_port)
        worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        state = WorkerState(role, worker_id, loop, ucx_address=transport.address,
                            tracing=Tracing.start(f"splitserve-{role}", args.otlp_endpoint, worker_id))
        loop.on_cache_events = state.cache_events.append
        state.transport = transport
        peers = KnownPeers(peer_role, getattr(args, peer_role))
        discovery = None
        if args.redis_url:
            from services.discovery import Discovery

            discovery = peers.discovery = Discovery(args.redis_url, engine.model_id, peers, token=token,
                                                    layout=layout_dict(engine))
            await discovery.refresh()
            discovery.start()
        if not peers.configured:
            log.warning("no %s workers known (--%s, --redis-url): this worker will refuse every "
                        "request that names one", peer_role, peer_role)
        servicer = make_servicer(state, transport, peers, token)
        state.extra_counters = lambda: numeric_fields(servicer.stats)
        server = grpc.aio.server(interceptors=server_interceptors(token))
        add_to_server(servicer, server)
        on_stop = [servicer.close, transport.close, *([discovery.close] if discovery else [])]
        return await serve(server, args, state, [service_name], on_stop, token)

    try:
        code = asyncio.run(amain())
    except Exception:
        # e.g. the gRPC port is taken.  The engine and UCX threads would keep a
        # failed worker alive, unseen by whatever supervises it: exit for real.
        log.exception("splitserve %s: failed", role)
        logging.shutdown()
        os._exit(1)
    if code:
        raise SystemExit(code)


async def drain(state: WorkerState, timeout: float) -> None:
    """Graceful shutdown, first half: say so in the load reports (frontends
    route nothing new here; new calls are refused), then let the requests in
    flight finish, for at most `timeout` seconds."""
    state.draining = True
    deadline = asyncio.get_running_loop().time() + timeout
    log.info("%s %s draining: %d requests in flight", state.role, state.worker_id, state.engine.num_streams)
    while state.engine.num_streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if state.engine.num_streams:
        log.warning("drain timeout: cutting %d requests (their streams resume elsewhere)",
                    state.engine.num_streams)


async def serve(server: grpc.aio.Server, args: argparse.Namespace, state: WorkerState,
                service_names: list[str], on_stop: list,  # type: ignore[type-arg]
                token: str | None = None) -> int:
    """Until SIGTERM (-> 0) or the engine thread's death (-> 1: NOT_SERVING at once, then exit)."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    state.grpc_address = f"{advertise_host(args)}:{port}"
    state.metrics_url = start_metrics(state, args.host, args.metrics_port)
    await server.start()
    await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s %s serving on %s (UCX %s)", state.role, state.worker_id, state.grpc_address,
             state.ucx_address or "-")
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(state.grpc_address)
        os.replace(tmp, args.ready_file)
    registration = None
    if args.redis_url:
        from services.discovery import Registration

        registration = Registration(args.redis_url, state.engine.engine.model_id, state.role,
                                    state.worker_id, state.grpc_address,
                                    layout=layout_dict(state.engine.engine), token=token)
        registration.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    marked: list[asyncio.Task[None]] = []

    def on_death(err: BaseException) -> None:
        log.critical("%s %s: engine thread died (%r): NOT_SERVING, exiting", state.role, state.worker_id, err)
        state.draining = True  # load reports say so at once: frontends route elsewhere
        marked.append(asyncio.ensure_future(set_health(health_servicer, service_names,
                                                       health_pb2.HealthCheckResponse.NOT_SERVING)))
        stop.set()

    state.engine.on_death = on_death
    if state.engine.dead is not None:  # died while starting up
        on_death(state.engine.dead)
    await stop.wait()
    if marked:  # the streams already have the error: no point waiting for them long
        await asyncio.gather(*marked)
    await drain(state, 1.0 if state.engine.dead is not None else args.drain_timeout)
    if registration is not None:  # frontends stop routing here before the server stops
        await registration.stop()
    await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=1)
    for fn in on_stop:
        await fn()
    state.engine.stop()
    await asyncio.to_thread(state.tracing.shutdown)  # exports what is still queued
    from kvtransfer import shutdown_ucx

    shutdown_ucx()  # ucxx's notifier thread would otherwise keep the process alive
    return 1 if state.engine.dead is not None else 0


async def set_health(servicer: health.aio.HealthServicer, service_names: list[str],
                     status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
    for name in [*service_names, ""]:
        await servicer.set(name, status)
