"""One process, one asyncio loop: uvicorn (REST) and grpc.aio (Frontend.Generate),
the workers' load streams, and a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from engine.vocab.models import model_id, model_name
from services.frontend.config import FrontendConfig
from services.frontend.core import Frontend
from services.frontend.grpc_service import build_grpc_server, set_serving
from services.frontend.kv_router import KVAwareRouter, RandomRouter, RoundRobinRouter
from services.frontend.model_files import model_dir as resolve_model_dir
from services.frontend.rest import build_app
from services.frontend.router import LoadRouter, Router
from services.frontend.tokenizer import Tokenizer
from services.frontend.worker_pool import WorkerPool
from services.index import open_index
from services.sched_policy import serve_behind_compute
from services.tracing import Tracing

log = logging.getLogger("splitserve.frontend")
_HEALTH_POLL_S = 1.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: serve() owns SIGTERM/SIGINT so that
    gRPC and the worker streams stop in the same graceful sequence."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(config: FrontendConfig, stop: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (main thread) or until `stop` is set."""
    stop = stop or asyncio.Event()
    # Before the tokenizer, uvicorn and gRPC start their threads: they inherit it.
    serve_behind_compute(config.serving_sched)
    if threading.current_thread() is threading.main_thread():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    # Resolving the default model converts its GGUF once (the workers do the same);
    # after that it is a directory lookup.
    model_dir = await asyncio.to_thread(resolve_model_dir, config.model)
    tokenizer = Tokenizer(model_dir)
    name = config.served_model_name or model_name(config.model)
    # Workers say which weights they serve (name + digest); this frontend takes those it tokenizes for.
    mid = await asyncio.to_thread(model_id, config.model)
    index = open_index(mid, config.redis_url)
    pool = WorkerPool(config.decode, config.prefill, config.load_interval_seconds, mid,
                      index, cluster_token=config.cluster_token)
    discovery = None
    tracing = Tracing.start("splitserve-frontend", config.otlp_endpoint)
    try:
        starting = asyncio.create_task(pool.start(config.worker_wait_seconds))
        await asyncio.wait({starting, asyncio.create_task(stop.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            starting.cancel()
            return
        if config.discover_workers:  # the pool starts empty; workers come and go with their registrations
            from services.discovery import Discovery

            assert config.redis_url is not None
            from services.discovery import model_layout

            fixed = model_layout(model_dir, mid)
            discovery = Discovery(config.redis_url, mid, pool,
                                  config.discovery_interval_seconds, token=config.cluster_token,
                                  layout=lambda: {**fixed, **(pool.kv_layout() or {})})
            await discovery.refresh()
            discovery.start()
        fe = Frontend(config, tokenizer, pool, name, build_router(config, pool), tracing)
        try:
            await _serve(fe, config, stop)
        finally:
            fe.close()
    finally:
        if discovery is not None:
            await discovery.close()
        await pool.close()
        await asyncio.to_thread(tracing.shutdown)  # exports what is still queued


def build_router(config: FrontendConfig, pool: WorkerPool) -> Router:
    t = config.local_prefill_threshold
    if config.routing == "kv-aware" and pool.index is not None:
        return KVAwareRouter(pool.index, pool.layout, t, config.queue_weight,
                             request_cost=config.request_cost)
    if config.routing == "round-robin":
        return RoundRobinRouter(t)
    if config.routing == "random":
        return RandomRouter(t)
    return LoadRouter(t)


async def _serve(fe: Frontend, config: FrontendConfig, stop: asyncio.Event) -> None:
    grpc_server, health = build_grpc_server(fe, f"{config.host}:{config.grpc_port}")
    await grpc_server.start()
    uv = _Uvicorn(uvicorn.Config(build_app(fe), host=config.host, port=config.port, lifespan="off",
                                 log_level=config.log_level, access_log=config.log_level == "debug",
                                 ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
                                 # past the drain below, so that its 503s still go out
                                 timeout_graceful_shutdown=int(config.shutdown_grace_seconds) + 2))
    rest = asyncio.create_task(uv.serve(), name="uvicorn")
    health_task = asyncio.create_task(_publish_health(fe, health), name="grpc health")
    scheme = "https" if config.tls_cert else "http"
    log.info("frontend for %s: REST %s://%s:%d, gRPC %s:%d%s, %d decode + %d prefill workers%s",
             fe.model_name, scheme, config.host, config.port, config.host, config.grpc_port,
             " (TLS)" if config.tls_cert else "", len(fe.pool.decodes), len(fe.pool.prefills),
             f", {len(config.api_keys)} API key(s)" if config.api_keys else "")
    if not config.api_keys and not is_loopback(config.host):
        log.warning("no API key (--api-key or SPLITSERVE_API_KEY): anyone who can reach %s on ports %d "
                    "and %d can use this cluster, and read /metrics and /cluster", config.host,
                    config.port, config.grpc_port)
    # The start-up's objects (tokenizer, grpc, the web stack) live as long as the
    # process: out of the collector's sight, a full collection while serving walks
    # only what requests made (as the workers do, services/worker_serve.py).
    gc.freeze()
    try:
        await asyncio.wait({rest, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        log.info("frontend stopping (grace %.1f s)", config.shutdown_grace_seconds)
        health_task.cancel()
        uv.should_exit = True  # stops accepting; open connections finish
        grpc_stopped = asyncio.create_task(grpc_server.stop(config.shutdown_grace_seconds + 2))
        await fe.drain(config.shutdown_grace_seconds)
        await asyncio.gather(grpc_stopped, rest, return_exceptions=True)
    if not uv.started:
        raise SystemExit(f"frontend: REST server could not start on {config.host}:{config.port}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve to anything
        return False


async def _publish_health(fe: Frontend, health: object) -> None:
    serving: bool | None = None
    while True:
        ok, _ = fe.health()
        if ok != serving:
            serving = ok
            await set_serving(health, ok)  # type: ignore[arg-type]
        await asyncio.sleep(_HEALTH_POLL_S)


def run(config: FrontendConfig) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 130
    return 0
