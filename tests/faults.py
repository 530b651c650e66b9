"""Faults for worker processes, installed through the product's seam
(services/fault_hooks.py): start a worker with `fault_env(...)` added to its
environment.  Each fault logs a line starting "fault:" when it hits, so a test
can prove it did."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from services.fault_hooks import ENV, FaultHooks

log = logging.getLogger("tests.faults")

CRASH_FILE = "SPLITSERVE_TEST_CRASH_FILE"  # while it exists the engine thread raises outside step()
STEP_FAIL_FILE = "SPLITSERVE_TEST_STEP_FAIL_FILE"  # once it appears the next step raises (it is removed)
SEND_DELAY = "SPLITSERVE_TEST_SEND_DELAY"  # seconds a prefill worker waits before each KV send


def fault_env(*, crash_file: Path | None = None, step_fail_file: Path | None = None,
              send_delay: float | None = None) -> dict[str, str]:
    env = {ENV: "tests.faults:install"}
    if crash_file is not None:
        env[CRASH_FILE] = str(crash_file)
    if step_fail_file is not None:
        env[STEP_FAIL_FILE] = str(step_fail_file)
    if send_delay is not None:
        env[SEND_DELAY] = str(send_delay)
    return env


def install(hooks: FaultHooks, role: str) -> None:
    crash, step_fail = os.environ.get(CRASH_FILE), os.environ.get(STEP_FAIL_FILE)
    delay = float(os.environ.get(SEND_DELAY, "0"))
    if crash:
        def engine_iteration() -> None:
            if os.path.exists(crash):
                log.error("fault: engine thread crashes (%s exists)", crash)
                raise RuntimeError(f"injected engine-thread fault ({crash} exists)")
        hooks.engine_iteration = engine_iteration
    if step_fail:
        def before_step() -> None:
            if os.path.exists(step_fail):
                os.unlink(step_fail)
                log.error("fault: this step fails (%s)", step_fail)
                raise RuntimeError(f"injected step failure ({step_fail})")
        hooks.before_step = before_step
    if delay and role == "prefill":
        async def before_kv_send(request_id: str) -> None:
            log.warning("fault: KV send of %s waits %ss", request_id, delay)
            await asyncio.sleep(delay)
        hooks.before_kv_send = before_kv_send
