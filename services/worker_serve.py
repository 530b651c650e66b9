"""Running a worker: flags -> config -> engine (own thread) -> UCX transport ->
gRPC server with health and reflection, until SIGTERM (drain, then stop) or
the engine thread's death."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.llm_engine import LLMEngine
from kvtransfer.transport import KVTransport
from services.affinity import pin_worker
from services.cluster_auth import cluster_token, server_interceptors, warn_if_open
from services.engine_loop import EngineLoop
from services.fault_hooks import load_fault_hooks
from services.peers import KnownPeers
from services.sched_policy import serve_behind_compute
from services.tracing import Tracing
from services.worker_flags import advertise_host, peer_role, worker_engine_config
from services.worker_metrics import WorkerMetrics, start_metrics_server
from services.worker_state import WorkerState, numeric_fields

log = logging.getLogger(__name__)

# (state, transport, known peers, cluster token) -> the role's servicer
MakeServicer = Callable[[WorkerState, KVTransport, KnownPeers, str | None], Any]


async def start_transport(engine: LLMEngine, args: argparse.Namespace) -> KVTransport:
    """The UCX listener over this worker's KV cache memory."""
    transport = KVTransport(engine.runner.kv_cache, engine.kv_layout, host=advertise_host(args),
                            port=args.ucx_port, timeout_s=args.kv_transfer_timeout, listen_host=args.host)
    await transport.start()
    return transport


def run_worker(args: argparse.Namespace, role: str, make_servicer: MakeServicer,
               add_to_server: Callable[[Any, grpc.aio.Server], None], service_name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    # `kill -USR1 PID`: every thread's Python stack to stderr (a stop that hangs, a stuck request).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.cpus:
        args = pin_worker(args, role)
    try:
        config = worker_engine_config(args)  # bad configuration fails here, before anything starts
        faults = load_fault_hooks(role)
    except ValueError as e:
        raise SystemExit(f"splitserve {role}: {e}") from None

    token = cluster_token(args)
    warn_if_open(token, args.host, f"splitserve {role}")
    peers_role = peer_role(role)

    async def amain() -> int:
        engine = LLMEngine(config)
        loop = EngineLoop(engine, asyncio.get_running_loop(), faults=faults)
        loop.start()
        # The engine thread (and the kernel threads it starts) keep the default
        # policy; this thread and those it starts from here on (gRPC, UCX) serve behind them.
        serve_behind_compute(args.serving_sched)
        transport = await start_transport(engine, args)
        if faults.kv_send is not None:
            transport.fault = faults.kv_send
        worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        state = WorkerState(role, worker_id, loop, kv_address=transport.address,
                            tracing=Tracing.start(f"splitserve-{role}", args.otlp_endpoint, worker_id),
                            transport=transport, faults=faults)
        loop.on_cache_events = state.cache_events.append
        peers = KnownPeers(peers_role, getattr(args, peers_role))
        discovery = None
        if args.redis_url:
            from services.discovery import Discovery

            discovery = peers.discovery = Discovery(args.redis_url, engine.model_id, peers, token=token,
                                                    layout=engine.kv_layout.to_dict())
            await discovery.refresh()
            discovery.start()
        if not peers.configured:
            log.warning("no %s workers known (--%s, --redis-url): this worker will refuse every "
                        "request that names one", peers_role, peers_role)
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
                service_names: list[str], on_stop: list[Callable[[], Awaitable[None]]],
                token: str | None = None) -> int:
    """Until SIGTERM (-> 0) or the engine thread's death (-> 1: NOT_SERVING at once, then exit)."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    state.grpc_address = f"{advertise_host(args)}:{port}"
    state.metrics = WorkerMetrics(state, state.engine.engine.model_name)  # labels: the plain name
    state.metrics_url = start_metrics_server(state.metrics, args.host, args.metrics_port)
    await server.start()
    await set_health(health_servicer, service_names, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s %s serving on %s (UCX %s)", state.role, state.worker_id, state.grpc_address,
             state.kv_address or "-")
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
                                    layout=state.layout.to_dict(), token=token)
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
    # The ~300k objects of the start-up (model, tokenizer, torch, grpc) live as long
    # as the process: out of the collector's sight, neither a full collection while
    # serving nor the interpreter's exit walks them (seconds each on a busy core:
    # a SIGTERMed worker took 3-5 s to exit after it had stopped serving).
    gc.freeze()
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
