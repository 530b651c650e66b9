"""UCX settings that must be in the environment before ucxx creates its context.

ucxx reads them when it first initialises (the first listener or endpoint in
the process); kvtransfer applies them right before importing ucxx.  Values
already in the environment win, so an operator can still override any of them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

UCX_ENV_DEFAULTS: dict[str, str] = {
    # Every transport UCX finds: on one host that is shared memory + CMA + TCP,
    # which measured fastest; "sm" alone cannot connect, since the sockaddr
    # connection manager that listeners use needs TCP.
    "UCX_TLS": "all",
    # Without Python futures, every awaited ucxx request polls the event loop with
    # asyncio.sleep(0): one full core per process while merely waiting for a peer.
    # With them a notifier thread completes asyncio futures (see shutdown_ucx).
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    # A UCX thread progresses the worker, so transfers advance while the event loop
    # runs gRPC or engine steps, and a stalled loop does not stall the wire.
    "UCXPY_PROGRESS_MODE": "thread",
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: a warning per start.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


def apply_ucx_env_defaults() -> None:
    # The UCX context (UCX_*) and ucxx's application context (UCXPY_*) read these
    # on first use, not at import, so this still works after `import ucxx`.
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


# How long ucxx's progress thread waits in epoll when nothing wakes it, in ms.
# ucxx waits 1 ms: an idle worker's thread then woke about 900 times a second
# (3% of a core with nothing to do), and under load each wake-up took a core
# from the engine's kernels for a moment.  UCX wakes it through the same
# descriptor whenever a transfer, a connection or a request posted from
# another thread needs it: a longer wait did not slow transfers (KV transfer
# throughput the same at 1, 20 and 200 ms; the transfer tests pass), and 20 ms
# keeps a short bound for anything that would not wake it.
PROGRESS_WAIT_MS = 20


class _WorkerWithOurWait:
    """ucxx's worker as its ThreadMode sees it: the progress thread starts with
    PROGRESS_WAIT_MS as its epoll timeout; everything else is the worker's."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def start_progress_thread(self, polling_mode: bool = False, epoll_timeout: int = 1) -> None:
        self._worker.start_progress_thread(polling_mode=polling_mode, epoll_timeout=PROGRESS_WAIT_MS)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


def lengthen_progress_wait() -> None:
    """Call before the first listener or endpoint of the process (ucxx starts its
    progress thread then).  ucxx takes the epoll timeout as a constant of its
    ThreadMode (0.52); where that class is not where 0.52 has it, ucxx keeps its
    own wait and this logs why."""
    try:
        from ucxx._lib_async import application_context as ctx_module
    except ImportError as e:
        log.info("ucxx's progress thread keeps its own epoll wait: %s", e)
        return
    base = getattr(ctx_module, "ThreadMode", None)
    if base is None:
        log.info("ucxx's progress thread keeps its own epoll wait: no ThreadMode in %s", ctx_module.__name__)
        return
    if getattr(base, "splitserve_wait_ms", None) is not None:
        return  # done before in this process

    class ThreadMode(base):  # type: ignore[misc, valid-type]  # ucxx is untyped
        splitserve_wait_ms = PROGRESS_WAIT_MS

        def __init__(self, worker: Any, event_loop: Any, polling_mode: bool = False) -> None:
            super().__init__(_WorkerWithOurWait(worker), event_loop, polling_mode=polling_mode)

    ctx_module.ThreadMode = ThreadMode


def import_what_the_progress_thread_would() -> None:
    """Call in the thread that starts UCX, before it does.

    ucxx's progress thread, as it starts, imports cuda.core (for a CUDA
    context), which imports rlcompleter and with it readline, whose set-up
    puts LINES and COLUMNS into the environment.  glibc's environment is not
    safe across threads: that setenv, from the new thread while the main
    thread read the environment (getenv), crashed a worker at start with
    SIGSEGV.  Imported here first, the thread finds it loaded and sets nothing."""
    for name in ("cuda.core", "cuda.core.experimental"):  # what ucxx tries, in its order
        try:
            importlib.import_module(name)
            return
        except Exception:  # noqa: BLE001 - a pre-import only: ucxx's own import reports the error
            continue


def shutdown_ucx() -> None:
    """Stop ucxx's notifier thread; call once before the process exits.

    The thread is not a daemon: a process that skips this hangs at exit
    after its last KVTransport is closed.
    """
    ucxx = sys.modules.get("ucxx")
    if ucxx is None:
        return
    # The thread checks for shutdown once a second; waking it through the worker
    # (private in ucxx 0.52, hence the care) makes this instant instead.
    ctx = getattr(getattr(ucxx, "core", None), "_ctx", None)
    if ctx is not None:
        with contextlib.suppress(Exception):
            ctx.worker.stop_request_notifier_thread()
    ucxx.stop_notifier_thread()
