"""Pinning workers to cores, so that on a small machine a prefill worker's
long prompt does not take the decode worker's core (the point of splitting
them).  `splitserve up --cpu-affinity SPEC` plans it; each worker pins itself
with `--cpus LIST` before it starts any threads of its own.

    auto      each worker its own cores when there are at least as many usable
              cores as workers (prefill and decode in proportion to their
              counts); otherwise no pinning.  Where that leaves fewer than 2
              cores a worker, the decode workers also run on the prefill
              cores (1 prefill + 1 decode on 2 cores: prefill on the first,
              decode on both): a decode worker of one core is too slow for
              its batch while the prefill worker idles between prompts, and
              the kernels' work claiming evens out the time a shared core
              gives the prefill worker (Zen 5, mixed workload: 235-251 tok/s
              against 203-215 with disjoint cores).  The frontend, an
              asyncio process that mostly waits, stays unpinned.
    off       no pinning
    prefill=0;decode=1-3   explicit cores per role, split among that role's
              workers (shared when there are fewer cores than workers)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

log = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpu list {text!r}: {part!r} is not a number or a range") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu list {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"cpu list {text!r} is empty")
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def split_evenly(cpus: list[int], n: int) -> list[list[int]]:
    """`n` contiguous, disjoint slices of `cpus`, sizes differing by at most
    one; every slice is all of `cpus` when there are fewer cpus than n."""
    if len(cpus) < n:
        return [list(cpus) for _ in range(n)]
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(cpus[start:end])
        start = end
    return out


def plan_affinity(spec: str, num_prefill: int, num_decode: int,
                  available: list[int]) -> dict[str, list[int]]:
    """Worker name ("prefill-0", "decode-1", ...) -> its cores; empty for no pinning."""
    spec = spec.strip()
    counts = {"prefill": num_prefill, "decode": num_decode}
    if spec == "off":
        return {}
    if spec == "auto":
        workers = num_prefill + num_decode
        if workers < 2 or len(available) < workers:
            return {}  # one worker: nothing to separate; too few cores: no disjoint sets
        share = round(len(available) * num_prefill / workers)
        n_prefill = min(max(num_prefill, share), len(available) - num_decode)
        role_cpus = {"prefill": available[:n_prefill], "decode": available[n_prefill:]}
        shared = role_cpus["prefill"] if num_prefill and len(available) < 2 * workers else []
    else:
        shared = []
        role_cpus = {}
        for item in spec.replace(";", " ").split():
            role, sep, cpu_list = item.partition("=")
            if not sep or role not in counts:
                raise ValueError(f"--cpu-affinity {spec!r}: expected auto, off or prefill=LIST;decode=LIST")
            role_cpus[role] = parse_cpu_list(cpu_list)
        for role, cpus in role_cpus.items():
            if not set(cpus) <= set(available):
                raise ValueError(f"--cpu-affinity: {role} cpus {format_cpu_list(cpus)} are not all "
                                 f"usable here (usable: {format_cpu_list(available)})")
    plan: dict[str, list[int]] = {}
    for role, cpus in role_cpus.items():
        if not counts[role]:
            continue
        for i, part in enumerate(split_evenly(cpus, counts[role])):
            plan[f"{role}-{i}"] = sorted(set(part) | set(shared)) if role == "decode" else part
    return plan


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process (imports may already have started
    some) to `cpus`; threads started later inherit it."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--cpus: this platform cannot pin threads to cores")
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, cpus)


def pin_worker(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """Pins the process to --cpus before the engine starts its threads; the
    flags with --num-threads defaulted to the number of those cores."""
    try:
        cpus = parse_cpu_list(args.cpus)
        pin_process(cpus)
    except (ValueError, OSError) as e:
        raise SystemExit(f"splitserve {role}: --cpus {args.cpus}: {e}") from None
    log.info("pinned to cpus %s", args.cpus)
    return argparse.Namespace(**{**vars(args), "num_threads": args.num_threads or len(cpus)})
