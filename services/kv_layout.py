"""A worker's KV layout (docs/ARCHITECTURE.md, invariant 7), built once from its engine's
cache and carried as is: by the UCX handshake (kvtransfer), by each Prefill RPC
(the protobuf below) and by a Redis registration (a dict).  Two workers'
layouts are compared in one place, `kvtransfer.layout.check_compatible`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvtransfer.layout import KVLayout, LayoutMismatch, check_compatible
from protos import pb

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

_FIELDS = tuple(f.name for f in dataclasses.fields(KVLayout))


def engine_layout(engine: LLMEngine) -> KVLayout:
    """What this engine's blocks are: the cache tensor's own shape and dtype (fp8 or
    the model's), and the model's compute dtype."""
    return KVLayout.from_cache(engine.runner.kv_cache, engine.model_id, engine.runner.dtype)


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**layout.to_dict())


def layout_from_proto(p: pb.KVLayout) -> KVLayout:
    """ValueError when a field is missing or invalid."""
    return KVLayout(**{f: getattr(p, f) for f in _FIELDS})


def layout_mismatch(mine: KVLayout, theirs: pb.KVLayout) -> str | None:
    """Why a peer's layout (as a request carries it) cannot take this worker's
    blocks byte for byte, or None when it can."""
    try:
        check_compatible(mine, layout_from_proto(theirs))
    except LayoutMismatch as e:
        return str(e)
    except ValueError as e:  # not a layout at all (a field missing or invalid)
        return f"layout: {e}"
    return None
