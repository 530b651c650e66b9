"""The supervisor with real (tiny) child processes: a child that dies is
restarted with the same argv after a doubling back-off and logged as back once
ready; more deaths than the limit within the window is a crash loop; stop()
ends every child with SIGTERM and restarts nothing after."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from services.supervisor import CrashLoop, RestartPolicy, Supervisor

# Writes its pid to the ready file, then waits to be killed.
SERVE = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"


def supervise_until(sup: Supervisor, cond, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        sup.check()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_back_off_doubles_and_is_capped() -> None:
    p = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [p.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_killed_child_is_restarted_with_its_argv_and_logged_back(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = Supervisor(RestartPolicy(max_restarts=3, backoff_initial_s=0.05), log=lines.append)
    ready = tmp_path / "w.ready"
    first = sup.spawn("worker-0", [sys.executable, "-c", SERVE, str(ready)], ready_file=ready)
    try:
        supervise_until(sup, ready.exists)
        first.send_signal(signal.SIGKILL)
        first.wait()
        supervise_until(sup, lambda: any("is back" in line for line in lines))
        second = sup.children[0].popen
        assert second.pid != first.pid and second.poll() is None
        assert ready.read_text() == str(second.pid)  # the new process wrote it, not the old one
        assert lines[0].startswith(f"worker-0 (pid {first.pid}) was killed by SIGKILL; restarting in 0.1 s")
        assert lines[1] == f"worker-0 restarted (pid {second.pid}, restart 1)"
        assert lines[2] == f"worker-0 is back (pid {second.pid})"
    finally:
        sup.stop(grace_s=5)
    assert all(c.popen.poll() is not None for c in sup.children)


def test_a_child_that_keeps_dying_is_a_crash_loop(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = Supervisor(RestartPolicy(max_restarts=2, window_s=60, backoff_initial_s=0.05), log=lines.append)
    sup.spawn("decode-1", [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(CrashLoop, match=r"decode-1 exited with 3; it died 3 times within 60 s \(crash loop"):
        supervise_until(sup, lambda: False)
    assert [line.split(" (pid")[0] for line in lines] == ["decode-1", "decode-1 restarted"] * 2
    assert "restarting in 0.1 s (2 of 2 restarts within 60 s)" in lines[2]
    sup.stop(grace_s=5)


def test_stop_terminates_every_child_and_restarts_nothing(tmp_path: Path) -> None:
    order = tmp_path / "order"
    # Each child appends its name to `order` when SIGTERM arrives, then exits 0
    # from the handler itself (os._exit: wherever the signal lands, nothing after
    # the handler can change the status).
    child = ("import os, signal, sys, time\n"
             "def bye(*_):\n"
             "    with open(sys.argv[1], 'a') as f:\n        f.write(sys.argv[2] + '\\n')\n"
             "    os._exit(0)\n"
             "signal.signal(signal.SIGTERM, bye)\n"
             "open(sys.argv[1] + sys.argv[2], 'w').close()\ntime.sleep(600)\n")
    sup = Supervisor(RestartPolicy(backoff_initial_s=0.05), log=lambda _: None)
    for name in ("prefill-0", "decode-0", "frontend"):
        sup.spawn(name, [sys.executable, "-c", child, str(order), name])
    names = ("prefill-0", "decode-0", "frontend")
    supervise_until(sup, lambda: all(Path(f"{order}{n}").exists() for n in names))
    sup.stop(grace_s=10)
    assert all(c.popen.returncode == 0 for c in sup.children)
    sup.check()  # stopping: nothing is restarted
    assert all(c.popen.poll() == 0 and c.restarts == 0 for c in sup.children)
    assert sorted(order.read_text().split()) == ["decode-0", "frontend", "prefill-0"]


def test_a_restart_that_never_gets_ready_is_killed_and_counted(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = Supervisor(RestartPolicy(max_restarts=1, backoff_initial_s=0.05, start_timeout_s=0.3),
                     log=lines.append)
    ready = tmp_path / "never"
    first = sup.spawn("decode-0", [sys.executable, "-c", "import time; time.sleep(600)"], ready_file=ready)
    first.kill()
    first.wait()
    with pytest.raises(CrashLoop, match="decode-0 was killed by SIGKILL; it died 2 times"):
        supervise_until(sup, lambda: False)
    assert "not ready 0 s after its restart; killing it" in lines[2]
    sup.stop(grace_s=5)
