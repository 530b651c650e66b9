"""The tests' fork server (tests/integration/forkserver.py) starts a module as
`python -m` would: its arguments, environment, output and exit status, and
the engine's OpenMP setting a worker gets; it hands back what it cannot match."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration import forkserver

ME = "tests.integration.test_forkserver"


def spawn(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.Popen[bytes] | forkserver.Forked, Path]:
    log = tmp_path / "probe.log"
    with open(log, "wb") as out:
        # The server's own start environment: this process's may since have gained
        # settings a server cannot take (the other tests', e.g. a library's own).
        proc = forkserver.popen(ME, list(args), env={**forkserver.client().env, **env},
                                stdout=out.fileno())
    return proc, log


def test_a_forked_module_runs_as_python_m_would(tmp_path: Path) -> None:
    proc, log = spawn(tmp_path, "exit", "7", PROBE_VALUE="seen")
    assert isinstance(proc, forkserver.Forked)
    assert proc.wait(timeout=60) == 7
    lines = log.read_text().splitlines()
    assert lines == [f"argv {Path(__file__).resolve()} exit 7", "env seen", f"cwd {forkserver.ROOT}",
                     f"session {proc.pid}", "openmp sleeps True"]


def test_a_killed_child_reports_its_signal(tmp_path: Path) -> None:
    proc, log = spawn(tmp_path, "wait")
    deadline = time.monotonic() + 60
    while "waiting" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_default_the_preload_filled_in_may_be_given_or_not(tmp_path: Path) -> None:
    """The test process itself gains the UCX defaults once a test makes a KV
    transport in it: its later spawns still match."""
    proc, _ = spawn(tmp_path, "exit", "0", UCX_TLS="all", OMP_WAIT_POLICY="PASSIVE")
    assert isinstance(proc, forkserver.Forked)
    assert proc.wait(timeout=60) == 0


def test_a_setting_read_after_the_preload_is_the_childs_own(tmp_path: Path) -> None:
    """torch's inductor sets its cache directory in the test process when it
    first compiles; a child forked with another one still uses its own."""
    proc, log = spawn(tmp_path, "inductor", "0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    assert isinstance(proc, forkserver.Forked)
    assert proc.wait(timeout=60) == 0, log.read_text()
    assert f"inductor cache {tmp_path / 'inductor'}" in log.read_text().splitlines()


def test_an_environment_it_cannot_match_starts_fresh(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="starts fresh: OMP_WAIT_POLICY differ"):
        proc, log = spawn(tmp_path, "exit", "0", OMP_WAIT_POLICY="ACTIVE")
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=120) == 0
    assert "openmp sleeps False" in log.read_text()  # as a fresh interpreter told ACTIVE decides


if __name__ == "__main__":  # the probe the tests start
    import engine

    print("argv", *sys.argv)
    print("env", os.environ.get("PROBE_VALUE"))
    print("cwd", os.getcwd())
    print("session", os.getsid(0))
    print("openmp sleeps", engine.OPENMP_SLEEPS)
    if sys.argv[1] == "inductor":
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        print("inductor cache", cache_dir())
    if sys.argv[1] == "wait":
        print("waiting", flush=True)
        signal.pause()
    sys.exit(int(sys.argv[2]))
