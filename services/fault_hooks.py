"""The fault-injection seam: the few points where a test makes a worker
misbehave in ways it cannot cause from outside (an engine bug, a slow or hung
KV sender).  Product code only calls these hooks; the faults live in tests/
(tests/faults.py).

    SPLITSERVE_FAULT_PLUGIN=module:function

names a function `function(hooks: FaultHooks, role: str) -> None` that a
starting worker calls once, before its engine thread and its KV transport
start, to set the hooks it wants.  It is the one way tests rig a worker.
Unset (every real deployment): no hooks, nothing is imported.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtransfer.sender import SendFault

log = logging.getLogger(__name__)

ENV = "SPLITSERVE_FAULT_PLUGIN"


@dataclass
class FaultHooks:
    # Engine thread, once per loop iteration, outside step(): raising ends the
    # thread, as an engine bug would (services/engine_loop.py).
    engine_iteration: Callable[[], None] | None = None
    # Engine thread, before each step(): raising fails that step (its requests
    # fail; the worker serves on).
    before_step: Callable[[], None] | None = None
    # Prefill worker, on the event loop, once a prompt is computed and before its
    # KV is sent (argument: the request id): a slow or hung sender.
    before_kv_send: Callable[[str], Awaitable[None]] | None = None
    # Prefill worker's UCX sender, in the middle of each transfer: kvtransfer's own
    # test seam (a stall after some blocks have moved), set on its transport.
    kv_send: SendFault | None = None


def load_fault_hooks(role: str, environ: Mapping[str, str] = os.environ) -> FaultHooks:
    hooks = FaultHooks()
    spec = environ.get(ENV, "")
    if not spec:
        return hooks
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{ENV}: {spec!r} is not module:function")
    install = getattr(importlib.import_module(module), name)
    install(hooks, role)
    log.warning("fault hooks from %s installed (%s): this worker is rigged for tests", spec,
                ", ".join(k for k, v in vars(hooks).items() if v is not None) or "none set")
    return hooks
