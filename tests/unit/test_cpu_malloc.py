"""engine/layers/cpu_malloc.py: with the CPU engine's malloc thresholds, the
memory of big tensors a step frees stays in the heap for the next step (no
page faults to take it again); with glibc's defaults it goes back to the OS.
Each case runs in a fresh process: the settings are per process, and a test
process has allocated much already.  (What it is worth in time is in
benchmarks/README.md; tests time nothing.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Three 20 MiB chunks (a prefill chunk's activations are of that size) taken
# and freed through malloc itself; glibc's own account of where they came from
# and where they went (mallinfo2: bytes of the heap, of mmapped chunks, free
# at the heap's top).
HEAP = """
import ctypes, sys
from engine.layers import cpu_malloc
fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
          "keepcost")
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in fields]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "kept":
    print("applied", cpu_malloc.keep_freed_memory())
def info(when):
    m = libc.mallinfo2()
    print(when, m.arena, m.hblkhd, m.keepcost)
info("before")
chunks = [libc.malloc(20 << 20) for _ in range(3)]
info("held")
for p in chunks:
    libc.free(p)
info("freed")
"""
MIB = 1 << 20


def run(code: str, *args: str, env: dict[str, str] | None = None) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                         check=True, env=env or dict(os.environ), timeout=300).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def heap(mode: str) -> dict[str, tuple[int, int, int]]:
    """when -> (heap bytes, mmapped bytes, free bytes at the heap's top)."""
    out = run(HEAP, mode)
    assert out.get("applied", "True") == "True", out
    return {k: tuple(int(x) for x in v.split()) for k, v in out.items() if k != "applied"}  # type: ignore[misc]


def test_freed_chunks_stay_in_the_heap_for_the_next_step() -> None:
    default, kept = heap("default"), heap("kept")
    # glibc's defaults: mapped for the request, unmapped when freed (faulted in again next time).
    assert default["held"][1] - default["before"][1] >= 55 * MIB
    assert default["freed"][1] == default["before"][1] and default["freed"][0] == default["before"][0]
    # Kept: taken from the heap, and still there once freed, ready for the next step.
    assert kept["held"][0] - kept["before"][0] >= 55 * MIB and kept["held"][1] == kept["before"][1]
    assert kept["freed"][0] == kept["held"][0] and kept["freed"][2] >= 55 * MIB


def test_the_users_own_malloc_settings_are_left_alone() -> None:
    code = "from engine.layers import cpu_malloc; print('applied', cpu_malloc.keep_freed_memory())"
    assert run(code)["applied"] == "True"
    # (a preload that is not there: ld.so warns and goes on; the variable is what counts)
    for name, value in (("MALLOC_TRIM_THRESHOLD_", "1000000"), ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
                        ("LD_PRELOAD", "/nonexistent/libjemalloc.so.2")):
        assert run(code, env={**os.environ, name: value})["applied"] == "False", name


def test_the_cpu_engine_applies_them() -> None:
    code = ("from engine import LLM; from engine.layers import cpu_malloc\n"
            "LLM(dtype='float32', num_blocks=16, num_threads=1, max_model_len=256)\n"
            "print('applied', cpu_malloc.keep_freed_memory.cache_info().currsize == 1 "
            "and cpu_malloc.keep_freed_memory())")
    assert run(code)["applied"] == "True"
