"""Run the fault and timing-sensitive test modules many times; report how often
each test failed.  `make flaky`; FLAKY_RUNS (default 20) sets the number of
runs, FLAKY_TESTS (pytest arguments, space-separated) what runs.  Exits 1 if
any test failed in any run."""

from __future__ import annotations

import collections
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.timing_sensitive import FAULT_TESTS as DEFAULT_TESTS  # noqa: E402


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed | failed | skipped, from one run's JUnit XML."""
    out: dict[str, str] = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        out[name] = ("failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags
                     else "passed")
    return out


def chaos_lines(junit: Path) -> list[str]:
    """The chaos test's figures (its `chaos: seed ...` lines), from one run's captured output."""
    if not junit.exists():
        return []
    return [line.strip() for case in ET.parse(junit).getroot().iter("testcase")
            for out in case.iter("system-out") for line in (out.text or "").splitlines()
            if line.startswith("chaos: seed") and "faults" in line]


def main() -> int:
    runs = int(os.environ.get("FLAKY_RUNS", "20"))
    tests = shlex.split(os.environ.get("FLAKY_TESTS", "")) or DEFAULT_TESTS
    failures: collections.Counter[str] = collections.Counter()
    seen: collections.Counter[str] = collections.Counter()
    broken_runs = 0  # runs that ended without a report (a crash, a collection error)
    chaos: list[str] = []
    with tempfile.TemporaryDirectory(prefix="flaky-") as tmp:
        for i in range(1, runs + 1):
            junit = Path(tmp) / f"run{i}.xml"
            start = time.monotonic()
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "-o", "junit_logging=system-out", f"--junitxml={junit}",
                                  f"--basetemp={tmp}/base{i}", *tests], cwd=ROOT)
            results = outcomes(junit)
            chaos += chaos_lines(junit)
            if rc not in (0, 1) or not results:
                broken_runs += 1
            for name, outcome in results.items():
                seen[name] += 1
                failures[name] += outcome == "failed"
            print(f"flaky: run {i}/{runs}: exit {rc}, {sum(o == 'failed' for o in results.values())} failed, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
    print(f"\nflaky: {runs} runs of {' '.join(tests)}")
    for line in chaos:
        print(f"  {line}")
    for name in sorted(seen, key=lambda n: (-failures[n], n)):
        if failures[name]:
            print(f"  FAILED {failures[name]:3d}/{seen[name]}  {name}")
    print(f"  {sum(1 for n in seen if not failures[n])} tests passed every run; "
          f"{sum(1 for n in seen if failures[n])} failed at least once; {broken_runs} runs broke")
    return 1 if broken_runs or any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
