"""The packed weights and the KV cache on 2 MiB pages (engine/layers/huge_pages.py):
a moved tensor keeps its values, views and sharing, its pages are asked to be
huge (MADV_HUGEPAGE, VmFlags "hg"), and SPLITSERVE_HUGE_PAGES=0 moves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.layers import huge_pages

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
