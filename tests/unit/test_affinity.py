"""`splitserve up --cpu-affinity`: the plan (pure) and the pinning (in a child
process, so the test runner keeps its cores)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.affinity import format_cpu_list, parse_cpu_list, plan_affinity, split_evenly


def test_parse_and_format_cpu_lists() -> None:
    assert parse_cpu_list("0-2,5, 7") == [0, 1, 2, 5, 7]
    assert parse_cpu_list("3,1,1") == [1, 3]
    assert format_cpu_list([0, 1, 4]) == "0,1,4"
    for bad in ("", "a", "3-1", "-1", "1-x"):
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)


def test_split_evenly() -> None:
    assert split_evenly([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly([4, 5], 2) == [[4], [5]]
    assert split_evenly([0, 1], 3) == [[0, 1]] * 3  # too few: shared


def test_auto_plan() -> None:
    # the small machine: the prefill worker one core, the decode worker both (under 2
    # cores a worker, it shares the prefill cores); the frontend unpinned
    assert plan_affinity("auto", 1, 1, [0, 1]) == {"prefill-0": [0], "decode-0": [0, 1]}
    assert plan_affinity("auto", 1, 1, [0, 1, 2, 3]) == {"prefill-0": [0, 1], "decode-0": [2, 3]}
    # bigger: cores in proportion to the worker counts, disjoint
    plan = plan_affinity("auto", 1, 3, list(range(16)))
    assert plan == {"prefill-0": [0, 1, 2, 3], "decode-0": [4, 5, 6, 7], "decode-1": [8, 9, 10, 11],
                    "decode-2": [12, 13, 14, 15]}
    plan = plan_affinity("auto", 3, 1, [0, 1, 2, 3])  # every prefill worker still gets a core
    assert plan == {"prefill-0": [0], "prefill-1": [1], "prefill-2": [2], "decode-0": [0, 1, 2, 3]}
    # colocated (one worker), or more workers than cores: nothing to pin
    assert plan_affinity("auto", 0, 1, [0, 1]) == {}
    assert plan_affinity("auto", 2, 2, [0, 1]) == {}
    assert plan_affinity("auto", 0, 2, [0, 1]) == {"decode-0": [0], "decode-1": [1]}
    assert plan_affinity("off", 1, 1, [0, 1]) == {}


def test_explicit_plan() -> None:
    plan = plan_affinity("prefill=0;decode=1-3", 1, 2, [0, 1, 2, 3])
    assert plan == {"prefill-0": [0], "decode-0": [1, 2], "decode-1": [3]}
    assert plan_affinity("decode=1", 1, 1, [0, 1]) == {"decode-0": [1]}  # prefill unpinned
    assert plan_affinity("prefill=0 decode=0", 0, 1, [0, 1]) == {"decode-0": [0]}
    with pytest.raises(ValueError, match="expected auto"):
        plan_affinity("frontend=0", 1, 1, [0, 1])
    with pytest.raises(ValueError, match="not all usable"):
        plan_affinity("prefill=0;decode=9", 1, 1, [0, 1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_process_pins_threads_started_before_it() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, threading, time\n"
        "from services.affinity import pin_process\n"
        "ev = threading.Event(); seen = []\n"
        "t = threading.Thread(target=lambda: (ev.wait(), seen.append(os.sched_getaffinity(0))))\n"
        "t.start(); time.sleep(0.05)\n"
        f"pin_process([{cpu}]); ev.set(); t.join()\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("] [") == [f"[{cpu}", f"{cpu}]\n"]
