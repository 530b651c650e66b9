"""The packed weights and the KV cache on 2 MiB pages (transparent huge pages).

A decode step streams every packed weight through the cores, hundreds of MiB
of them, and reads each sequence's KV blocks from all over the cache.  On
4 KiB pages each page costs a TLB miss (the core walks the page tables while
the kernel waits on the line); on 2 MiB pages the misses are 512 times fewer.
On a Zen 5 (family 26 model 2, 2 cores), interleaved in one process:

- the 120 bfloat16 projections of a 30-layer model of 576: 8 rows 6.89 ->
  6.10 ms, 32 rows 9.96 -> 9.51 ms;
- 30 layers of decode attention, 32 sequences of an fp8 e4m3 cache:
  context 125 2.53 -> 2.39 ms, context 500 10.97 -> 10.31 ms.

Linux gives huge pages to a private anonymous mapping that asks for them
(MADV_HUGEPAGE) where /sys/kernel/mm/transparent_hugepage/enabled is "always"
or "madvise" (most distributions' default); under "never" the same mapping
stays on 4 KiB pages and works as before.  Packed weights mapped from their
cache file are copied into such a mapping, so workers on one machine hold
their own copies rather than sharing the file's pages, and the copy is on
the start-up path: 470 MiB (a 135M model's bfloat16 panels, 4-bit blocks and
head) in 0.9 s on the Zen 5 above, a VM whose host backs fresh 2 MiB pages
slowly; a split stack's cold start 2.9 -> 4.4 s.  SPLITSERVE_HUGE_PAGES=0
keeps the weights where they are (shared) and the cache on 4 KiB pages."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Smaller storages (biases, a small layer's scales) stay where they are: a few pages each.
MIN_BYTES = 64 << 10
ALIGN = 64  # each storage from a cache line: every dtype's elements stay aligned


def enabled() -> bool:
    """Whether the weights and the KV cache go on huge pages (SPLITSERVE_HUGE_PAGES, on unless "0")."""
    return os.environ.get("SPLITSERVE_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def anonymous_bytes(nbytes: int, huge: bool, align: bool = False, dump: bool = True) -> torch.Tensor:
    """nbytes zero bytes (uint8) in a private anonymous mapping, none of its
    pages touched yet (the OS zero-fills each on first use); on huge pages if
    asked, from a 2 MiB boundary if `align` (a big mapping loses at most its
    partial first and last 2 MiB without); left out of core dumps unless
    `dump`.  The tensor keeps the mapping alive."""
    pad = HUGE_PAGE if huge and align else 0
    buf = mmap.mmap(-1, max(nbytes, 1) + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice, wanted in ((getattr(mmap, "MADV_HUGEPAGE", None), huge),
                           (getattr(mmap, "MADV_DONTDUMP", None), not dump)):
        if wanted and advice is not None:
            try:
                buf.madvise(advice)
            except OSError as e:  # a kernel built without THP: EINVAL, 4 KiB pages as before
                log.debug("madvise(%d) refused: %s", advice, e)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE if pad else 0
    return raw[start:start + nbytes]


def kv_cache_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A KV cache of zeros whose pages the OS fills on first use (torch.zeros
    would write all of them on the start-up path: 5 s for 5 GiB on one core),
    on huge pages where enabled().  It stays out of core dumps: gigabytes, and
    what the users' prompts made.  So flagged, its mapping merges with no
    neighbour but another such cache: /proc/PID/smaps shows a worker's alone,
    at its size."""
    return anonymous_bytes(math.prod(shape) * dtype.itemsize, enabled(), dump=False).view(dtype).view(shape)


def move_to_huge_pages(tensors: Iterable[torch.Tensor | None]) -> int:
    """Copy the CPU storages of at least MIN_BYTES behind `tensors` into one
    huge-page arena and point each tensor there, in place (whoever holds the
    tensor reads the new pages; tensors that shared a storage share its
    copy).  Call it before anything keeps the tensors' data pointers (the
    decode stack).  -> bytes moved (0 where not enabled())."""
    if not enabled():
        return 0
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t is not None and t.device.type == "cpu" and t.untyped_storage().nbytes() >= MIN_BYTES:
            s = t.untyped_storage()
            storages.setdefault(s.data_ptr(), (s, []))[1].append(t)
    offsets, total = {}, 0
    for ptr, (s, _) in storages.items():
        offsets[ptr], total = total, total + -(-s.nbytes() // ALIGN) * ALIGN
    if not total:
        return 0
    arena = anonymous_bytes(total, huge=True, align=True)
    with torch.no_grad():
        for ptr, (old, views) in storages.items():
            at = arena.storage_offset() + offsets[ptr]  # bytes into the arena's storage
            arena[offsets[ptr]:offsets[ptr] + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in views:
                offset = at // t.element_size() + t.storage_offset()
                t.set_(arena.untyped_storage(), offset, t.size(), t.stride())
    log.info("packed weights on huge pages: %.1f MiB in %d storages", total / 2**20, len(storages))
    return total


# Prefault: how far past the blocks handed out the cache's pages are filled,
# and how much one call fills (a huge page).
PREFAULT_LEAD = 64 << 20
PREFAULT_CHUNK = HUGE_PAGE


def prefault_enabled() -> bool:
    """Whether a CPU KV cache's pages are filled ahead of use (SPLITSERVE_KV_PREFAULT, on unless "0")."""
    return os.environ.get("SPLITSERVE_KV_PREFAULT", "1") != "0"


class _PrefaultState:
    """What Prefault and its thread share: no tensor, so the thread never keeps
    the cache alive (Prefault's finalizer closes it)."""

    def __init__(self, size: int) -> None:
        self.cv = threading.Condition()
        self.size = size
        self.want = 0  # bytes from the cache's start to have filled
        self.done = 0  # bytes filled so far
        self.closed = False


class Prefault:
    """Fills a KV cache's pages ahead of the blocks handed out next, off the
    decode step's path.

    The OS fills a page of kv_cache_zeros when it is first written: a decode
    step's cache store (rope_and_store_kv) waited for it while both kernel
    threads stood by.  On the Zen 5 (family 26 model 2) VM, whose host backs
    fresh pages slowly (about 0.8 GB/s), 32 sequences' new blocks cost the
    30 layers' stores 0.46 ms a step against 0.20 with the pages filled.
    The block pool hands out the blocks it never handed out before in their
    order (engine/block_pool.py, high_water), so the pages the next steps
    write lie just past the highest block handed out.  A thread at idle
    priority (SCHED_IDLE: it runs when a core has nothing else to run, as
    while the engine's Python runs between steps) keeps `lead` bytes past
    that point filled, a huge page a call, through the kernels' touch_pages
    (a locked add of zero a page: a block handed out meanwhile keeps what a
    step wrote there).  Under load it falls behind and the steps fill the
    pages themselves, as before; the cache's resident size runs at most
    `lead` ahead of what the blocks used."""

    def __init__(self, cache: torch.Tensor, block_bytes: int,
                 touch: Callable[[torch.Tensor, int, int], None], lead: int = PREFAULT_LEAD) -> None:
        flat = cache.view(-1).view(torch.uint8)
        if flat.numel() != cache.size(0) * block_bytes:
            raise ValueError(f"Prefault: {flat.numel()} bytes are not {cache.size(0)} blocks "
                             f"of {block_bytes}")
        self._bytes = flat  # the thread holds it weakly
        self.block_bytes = block_bytes
        self.lead = lead
        self._state = _PrefaultState(flat.numel())
        self.thread = threading.Thread(target=_prefault, args=(self._state, weakref.ref(flat), touch),
                                       name="ss-prefault", daemon=True)
        _RUNNING[self._state] = self.thread
        self.thread.start()
        weakref.finalize(self, _close_prefault, self._state)

    @property
    def filled(self) -> int:
        """Bytes from the cache's start filled so far."""
        return self._state.done

    def ahead_of(self, blocks: int) -> None:
        """Blocks [0, blocks) were handed out: have `lead` bytes past them filled
        (the thread is woken once a huge page's worth more is wanted)."""
        s = self._state
        want = min(s.size, blocks * self.block_bytes + self.lead)
        if want >= s.want + PREFAULT_CHUNK or (want == s.size > s.want):
            with s.cv:
                s.want = max(s.want, want)
                s.cv.notify_all()

    def wait(self, nbytes: int, timeout: float) -> bool:
        """Until the first nbytes (at most the cache's) are filled -> whether they are."""
        s = self._state
        with s.cv:
            return s.cv.wait_for(lambda: s.done >= min(nbytes, s.size) or s.closed, timeout) and not s.closed


def _close_prefault(s: _PrefaultState) -> None:
    with s.cv:
        s.closed = True
        s.cv.notify_all()


# Each running filler's thread, by its state.  At exit every one is stopped
# and joined before the interpreter finalizes: a daemon thread that returned
# from touch_pages then would retake the GIL inside pybind11's release guard,
# and the interpreter ends such a thread by unwinding it through that
# destructor, which aborts the process ("terminate called without an active
# exception").
_RUNNING: dict[_PrefaultState, threading.Thread] = {}


@atexit.register
def _stop_prefaults() -> None:
    for s, thread in list(_RUNNING.items()):
        _close_prefault(s)
        thread.join(timeout=10)


def _idle_priority() -> None:
    """This thread under SCHED_IDLE (Linux), else at the lowest nice."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _prefault(s: _PrefaultState, ref: weakref.ref[torch.Tensor],
              touch: Callable[[torch.Tensor, int, int], None]) -> None:
    try:
        _fill(s, ref, touch)
    finally:
        _RUNNING.pop(s, None)


def _fill(s: _PrefaultState, ref: weakref.ref[torch.Tensor],
          touch: Callable[[torch.Tensor, int, int], None]) -> None:
    _idle_priority()
    while True:
        with s.cv:
            s.cv.wait_for(lambda: s.closed or s.want > s.done)
            if s.closed:
                return
            begin, end = s.done, min(s.want, s.done + PREFAULT_CHUNK)
        flat = ref()
        if flat is None:
            return
        try:
            touch(flat, begin, end)
        except Exception:  # noqa: BLE001 - a step fills its pages itself, as without this thread
            log.warning("KV cache prefault stopped", exc_info=True)
            _close_prefault(s)
            return
        del flat
        with s.cv:
            s.done = end
            s.cv.notify_all()
