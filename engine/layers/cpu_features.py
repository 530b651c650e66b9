"""What this CPU can run, read once from /proc/cpuinfo: the kernels pick
their instruction set at run time (one build serves every x86-64 machine),
and `dtype=auto` and the benchmarks name the machine from the same facts."""

from __future__ import annotations

import functools
import platform

# The flags that decide a kernel path, in the order the paths get faster.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
                "amx_bf16", "amx_tile")


@functools.cache
def cpuinfo() -> tuple[str, frozenset[str]]:
    """-> (model name, flags) of the first CPU; ('unknown', {}) off Linux."""
    name, flags = platform.processor() or "unknown", frozenset[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    name = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return name, flags


def has(flag: str) -> bool:
    return flag in cpuinfo()[1]


def fast_bf16() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX)."""
    return has("amx_bf16") or has("avx512_bf16")


def cpu_summary() -> str:
    """One line naming the machine for benchmark tables: model, cores, the
    kernel-relevant flags it has."""
    import os

    name, flags = cpuinfo()
    present = [f for f in KERNEL_FLAGS if f in flags]
    return f"{name}, {os.cpu_count()} CPUs, flags: {' '.join(present) or 'none of ' + ' '.join(KERNEL_FLAGS)}"
