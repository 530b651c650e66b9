"""glibc malloc settings for a process that runs the CPU engine.

A forward pass allocates and frees tensors of megabytes to tens of megabytes
each (a 2,000-token prompt's activations: 24 MiB for gate_up's output), dozens
a step.  With its defaults glibc hands chunks that large out by mmap, or, once
its dynamic threshold has risen, from the heap, whose top it gives back to the
OS (brk) as soon as more than twice that threshold is free.  Either way the
next step faults the same memory in again, page by page, each page zeroed by
the kernel.  On the main thread's arena (`LLM.generate` called from a script)
a 2,000-token prefill took 1.7-2.6 s in most processes on the Zen 5 of
benchmarks/README.md, 1.0-1.5 s with the thresholds fixed.  On a thread of its
own, as in a worker, the engine allocates from another arena, where the same
prefill took 1.1-1.6 s with or without them.

`keep_freed_memory()` fixes the thresholds (which also stops glibc moving them):
chunks up to 32 MiB come from the heap, and the heap keeps up to 512 MiB free
at its top for the next step, as a GPU framework's caching allocator keeps
freed blocks.  A process's resident size then stays at its high-water mark
instead of following each step.  Left alone where malloc is not glibc's, or
where the user set glibc's malloc options (MALLOC_*_ environment variables,
GLIBC_TUNABLES) or preloads another allocator."""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # glibc's upper limit for it on 64-bit
TRIM_THRESHOLD = 512 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


@functools.cache
def keep_freed_memory() -> bool:
    """Set the thresholds once per process; True where they are in force."""
    if any(os.environ.get(name) for name in _USER_SETTINGS):
        return False
    if any(lib in os.environ.get("LD_PRELOAD", "") for lib in ("jemalloc", "tcmalloc", "mimalloc")):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the CPU engine's malloc thresholds; glibc's defaults stay")
    return ok
