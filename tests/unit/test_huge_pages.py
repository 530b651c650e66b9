"""The packed weights and the KV cache on 2 MiB pages (engine/layers/huge_pages.py):
a moved tensor keeps its values, views and sharing, its pages are asked to be
huge (MADV_HUGEPAGE, VmFlags "hg"), and SPLITSERVE_HUGE_PAGES=0 moves nothing;
the KV cache's pages filled ahead of use (Prefault)."""

from __future__ import annotations

import ctypes
import gc
import os
import weakref
from pathlib import Path

import pytest
import torch

from engine.layers import huge_pages
from engine.layers.cpu_attention import load_linear_kernel

needs_thp = pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                               reason="this kernel has no transparent huge pages: MADV_HUGEPAGE is refused")


def vm_flags(ptr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds address ptr."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inside = lo <= ptr < hi
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def mapping_size(ptr: int) -> int:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return hi - lo
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.fixture(autouse=True)
def on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_HUGE_PAGES", raising=False)


def test_moved_tensors_keep_values_views_and_sharing() -> None:
    big = torch.randn(300, 1024)  # 1.2 MB
    half = big[150:]  # a view of the same storage
    panels = torch.randn(700, 512).bfloat16()  # 0.7 MB
    blocks = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    small = torch.randn(8 << 10)  # 32 KB: under MIN_BYTES
    want = [t.clone() for t in (big, half, panels, blocks, small)]
    small_ptr = small.data_ptr()
    sizes = sum(t.untyped_storage().nbytes() for t in (big, panels, blocks))

    moved = huge_pages.move_to_huge_pages([big, half, panels, blocks, small, None])

    assert moved == sizes  # each storage once, though two tensors view big's
    for t, w in zip((big, half, panels, blocks, small), want, strict=True):
        assert torch.equal(t, w)
    assert half.data_ptr() == big.data_ptr() + 150 * 1024 * 4  # still a view of big's storage
    half[0, 0] = 7.0
    assert big[150, 0] == 7.0
    assert small.data_ptr() == small_ptr  # too small to move
    # One arena, from a 2 MiB boundary.
    assert len({t.untyped_storage().data_ptr() for t in (big, half, panels, blocks)}) == 1
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0  # the first storage, at the arena's start


@needs_thp
def test_the_arena_asks_for_huge_pages() -> None:
    t = torch.randn(1 << 20)
    assert huge_pages.move_to_huge_pages([t]) == 4 << 20
    assert "hg" in vm_flags(t.data_ptr())


def test_switched_off_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_HUGE_PAGES", "0")
    t = torch.randn(1 << 19)
    ptr = t.data_ptr()
    assert huge_pages.move_to_huge_pages([t]) == 0
    assert t.data_ptr() == ptr
    kv = huge_pages.kv_cache_zeros((64, 4096), torch.float16)
    assert "hg" not in vm_flags(kv.data_ptr())
    assert "dd" in vm_flags(kv.data_ptr())


@needs_thp
def test_kv_cache_zeros_on_huge_pages_out_of_core_dumps() -> None:
    """The soak test (tests/integration/test_failover.py, rss_outside) tells
    a worker's caches from the rest of its memory in smaps by "dd".  (In one
    process with other caches, as here under pytest, a neighbour flagged
    alike may share the mapping.)"""
    kv = huge_pages.kv_cache_zeros((100, 30, 2, 16, 3, 64), torch.float8_e4m3fn)
    assert kv.shape == (100, 30, 2, 16, 3, 64) and kv.dtype == torch.float8_e4m3fn
    assert not kv.view(torch.uint8).any()
    flags = vm_flags(kv.data_ptr())
    assert "dd" in flags and "hg" in flags
    assert mapping_size(kv.data_ptr()) >= kv.numel()
    kv[7, 3, 1] = 1.5  # writable, and only there
    assert kv.float().sum() == 1.5 * 16 * 3 * 64


def resident(t: torch.Tensor, begin: int, end: int) -> list[bool]:
    """Whether each 4 KiB page of t's bytes [begin, end) is in memory (mincore(2))."""
    page = 4096
    lo = (t.data_ptr() + begin) // page * page
    n = -(-(t.data_ptr() + end - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    assert libc.mincore(lo, n * page, vec) == 0, os.strerror(ctypes.get_errno())
    return [bool(v & 1) for v in vec]


@pytest.fixture(scope="module")
def touch():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    return k.touch_pages


def test_touch_pages_fills_every_page_a_range_overlaps_and_changes_no_byte(touch) -> None:  # type: ignore[no-untyped-def]
    """From an address inside a page (a view 100 bytes in), three pages' worth
    of bytes overlap four pages: all four are filled, none after them, and
    the bytes read as before; a range outside the tensor is refused."""
    raw = huge_pages.anonymous_bytes(64 << 10, huge=False)
    view = raw[100:]
    view[5000] = 7
    touch(view, 0, 3 * 4096)
    assert resident(raw, 0, 4 * 4096) == [True] * 4
    assert not any(resident(raw, 4 * 4096, raw.numel()))
    assert int(view[5000]) == 7 and int(raw.sum()) == 7
    with pytest.raises(RuntimeError, match="not in"):
        touch(view, 0, view.numel() + 1)


def test_prefault_fills_pages_past_the_blocks_handed_out_and_keeps_their_bytes(touch) -> None:  # type: ignore[no-untyped-def]
    """A fresh cache has none of its pages; Prefault fills `lead` bytes past
    the blocks handed out (in the background: waited on, not slept on), no
    page beyond the huge page that ends them, and a block a step wrote keeps
    what it holds."""
    shape = (200, 30, 2, 16, 3, 64)  # 200 blocks of 184,320 bytes: 35 MiB
    kv = huge_pages.kv_cache_zeros(shape, torch.float8_e4m3fn)
    block, lead, size = kv[0].numel(), 4 << 20, kv.numel()
    assert not any(resident(kv, 0, size))
    kv[0, 5, 1] = 2.0  # block 0, handed out and written before the filler starts
    p = huge_pages.Prefault(kv, block, touch, lead=lead)
    p.ahead_of(1)
    assert p.wait(block + lead, timeout=60)
    assert all(resident(kv, 0, block + lead))
    past = block + lead + huge_pages.HUGE_PAGE  # a huge page is filled whole
    assert not any(resident(kv, past, size))
    p.ahead_of(100)  # a step of new blocks: the filler goes on past them
    assert p.wait(100 * block + lead, timeout=60)
    assert all(resident(kv, 0, 100 * block + lead))
    assert not any(resident(kv, 100 * block + lead + huge_pages.HUGE_PAGE, size))
    assert kv.float().sum() == 2.0 * 16 * 3 * 64 and (kv[0, 5, 1] == 2.0).all()
    p.ahead_of(200)  # the whole cache, not past it
    assert p.wait(size, timeout=60) and p.filled == size


def test_prefault_thread_ends_with_its_owner(touch) -> None:  # type: ignore[no-untyped-def]
    """The thread holds the cache weakly: an engine let go frees its cache,
    and the thread ends rather than waiting for more blocks forever."""
    kv = huge_pages.kv_cache_zeros((8, 30, 2, 16, 3, 64), torch.float8_e4m3fn)
    p = huge_pages.Prefault(kv, kv[0].numel(), touch, lead=0)
    thread, cache = p.thread, weakref.ref(kv)
    del p, kv
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive() and cache() is None


def test_prefault_refuses_a_cache_of_other_blocks(touch) -> None:  # type: ignore[no-untyped-def]
    kv = huge_pages.kv_cache_zeros((8, 30, 2, 16, 3, 64), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not 8 blocks"):
        huge_pages.Prefault(kv, kv[0].numel() + 1, touch)
