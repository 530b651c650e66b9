"""How a process's serving threads share the cores with the engine's compute.

On a small machine the frontend, a worker's event loop and its gRPC threads
wake for every streamed token.  Under Linux's default policy a thread that
wakes takes a core from whatever runs there, and when that is one of the
kernels' two compute threads the whole step waits for it: a kernel call ends
only once each of its pieces is done, and the preempted thread holds one.
Under SCHED_BATCH a waking thread does not preempt; it runs when a core comes
free or at the next scheduling tick, with the same fair share of CPU time as
before.  Streamed tokens leave up to a tick later; the steps stop stalling.
Zen 4, 2 vCPUs, the decode32 workload, the two policies alternating: TPOT p50
40.7 against 42.2 ms (benchmarks/README.md).
A core also comes free between a step's kernels: the kernels' idle worker
yields it while it waits for the next one (engine/layers/csrc/parallel_claim.h).

`serve_behind_compute("batch")` puts the calling thread under SCHED_BATCH,
and with it every thread it starts from then on (a new thread inherits its
creator's policy).  A worker calls it on its main thread once the engine
thread runs (the engine thread, and the kernel threads it starts, keep the
default policy); the frontend at start-up."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

SERVING_SCHED = ("batch", "normal")


def add_serving_sched_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--serving-sched", default="batch", choices=SERVING_SCHED,
                   help="batch: this process's serving threads (event loop, gRPC, HTTP) run under "
                        "SCHED_BATCH and do not preempt the engine's compute threads on the same "
                        "cores when a token streams out; normal: the OS default (Linux)")


def serve_behind_compute(policy: str) -> bool:
    """-> whether the calling thread now runs under SCHED_BATCH."""
    if policy not in SERVING_SCHED:
        raise ValueError(f"serving_sched: must be one of {', '.join(SERVING_SCHED)}, got {policy!r}")
    if policy == "normal" or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: this thread (Linux)
    except OSError as e:
        log.warning("SCHED_BATCH refused (%s): the serving threads keep the default policy", e)
        return False
    return True


def name_this_thread(name: str) -> None:
    """The calling thread's name as top, py-spy and /proc/PID/task/TID/comm show
    it (Linux, at most 15 bytes); nothing elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass
