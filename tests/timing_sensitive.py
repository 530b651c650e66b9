"""The tests a loaded machine can make flaky: they kill, stop, cancel or time
things.  `make flaky` repeats them (scripts/flaky.py).  `make test` runs the
rest of the suite first on two pytest workers, then these alone, one at a time
(tests/conftest.py marks them `serial`)."""

from __future__ import annotations

FAULT_TESTS = [
    "tests/unit/test_supervisor.py",
    "tests/unit/test_frontend_service.py",
    "tests/unit/test_frontend_tracing.py",
    "tests/unit/test_engine_loop.py",
    "tests/integration/test_failover.py",
    "tests/integration/test_worker_faults.py",
    "tests/integration/test_up_supervise.py",
    "tests/integration/test_chaos.py",
    "tests/integration/test_transfer_faults.py",
    "tests/integration/test_redis_faults.py",
    "tests/integration/test_combined_faults.py",
    "tests/integration/test_guided_failover.py",
    "tests/integration/test_kvtransfer.py",
    "tests/integration/test_discovery.py",
    "tests/integration/test_prefix_index_redis.py",
    "tests/integration/test_engine_death.py",
    "tests/integration/test_hostile_peers.py",
    "tests/integration/test_rolling_update.py",
    "tests/integration/test_multihost.py",
    "tests/integration/test_frontend.py::test_disconnect_stops_the_work_and_frees_every_block",
    "tests/integration/test_frontend.py::test_timeout_aborts_everywhere",
    # 20 requests at once against an admission limit of 2: at once only on a quiet machine.
    "tests/integration/test_frontend.py::test_overload_gets_429_at_once_and_the_admitted_finish",
    # /health must answer while the frontend works on a huge prompt: timed.
    "tests/integration/test_trust_frontend.py::test_a_huge_prompt_is_tokenized_off_the_event_loop",
    "tests/unit/test_frontend_hostile.py::test_huge_body_and_huge_prompt_are_refused_while_health_answers",
]

# These, and the routing tests (routing follows the workers' load reports; a
# killed worker must drop out within the heartbeat TTL): the suite's serial part.
SERIAL = (*FAULT_TESTS, "tests/integration/test_routing.py")


def is_serial(nodeid: str) -> bool:
    """nodeid: a test's pytest id (path::name[params])."""
    return any(nodeid == t or nodeid.startswith((f"{t}::", f"{t}[")) for t in SERIAL)


if __name__ == "__main__":  # the files holding them: what make test's second part collects
    print(" ".join(sorted({t.split("::")[0] for t in SERIAL})))
