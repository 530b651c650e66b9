"""services/sched_policy.py: the serving threads' policy, set on real threads."""

from __future__ import annotations

import os
import threading

import pytest

from services.frontend.config import parse_config
from services.sched_policy import name_this_thread, serve_behind_compute

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")


def policies_after(policy: str) -> tuple[bool, int, int]:
    """In a fresh thread: serve_behind_compute(policy), then a thread started
    from it -> (the call's result, the thread's policy, its child's)."""
    seen: dict[str, object] = {}

    def child() -> None:
        seen["child"] = os.sched_getscheduler(threading.get_native_id())

    def parent() -> None:
        seen["set"] = serve_behind_compute(policy)
        seen["parent"] = os.sched_getscheduler(threading.get_native_id())
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=parent)
    t.start()
    t.join()
    return seen["set"], seen["parent"], seen["child"]  # type: ignore[return-value]


def test_batch_holds_for_the_thread_and_the_threads_it_starts() -> None:
    mine = os.sched_getscheduler(threading.get_native_id())
    assert policies_after("batch") == (True, os.SCHED_BATCH, os.SCHED_BATCH)
    assert os.sched_getscheduler(threading.get_native_id()) == mine  # other threads: untouched


def test_normal_changes_nothing_and_a_bad_policy_is_named() -> None:
    assert policies_after("normal") == (False, os.SCHED_OTHER, os.SCHED_OTHER)
    with pytest.raises(ValueError, match="serving_sched"):
        serve_behind_compute("fifo")


def test_frontend_flag() -> None:
    assert parse_config(["--decode", "h:1"]).serving_sched == "batch"
    assert parse_config(["--decode", "h:1", "--serving-sched", "normal"]).serving_sched == "normal"
    with pytest.raises(SystemExit):
        parse_config(["--decode", "h:1", "--serving-sched", "rr"])


def test_name_this_thread() -> None:
    names: list[str] = []

    def run() -> None:
        name_this_thread("ss-test-thread-name-too-long")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            names.append(f.read().strip())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert names == ["ss-test-thread-"]  # 15 bytes, as Linux keeps them
