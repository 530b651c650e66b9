"""The prefill -> decode handoff at the protobuf edge: KVHandoff (engine/kv_handoff.py,
made by the decode engine, layout included) <-> the PrefillRequest fields that
mirror it.  Apart from services/convert.py because KVLayout needs torch (it checks
dtype names) and the frontend, which imports convert, must not load it.

The layout (docs/ARCHITECTURE.md, invariant 7) is built once, by the engine
(LLMEngine.kv_layout), and carried as is: by the UCX handshake (kvtransfer), by
each Prefill RPC (the handoff) and by Info and a Redis registration (a dict).
Two workers' layouts are compared in one place, `kvtransfer.layout.check_compatible`
(the handshake's and KVHandoff.check_layout's)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.kv_handoff import KVHandoff
from kvtransfer.layout import KVLayout
from protos import pb
from services.convert import lora_from_proto

_FIELDS = tuple(f.name for f in dataclasses.fields(KVLayout))


class InvalidLayout(ValueError):
    """A message's layout is not a layout at all (a field missing or invalid)."""


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**layout.to_dict())


def layout_from_proto(p: pb.KVLayout) -> KVLayout:
    """InvalidLayout when a field is missing or invalid."""
    try:
        return KVLayout(**{f: getattr(p, f) for f in _FIELDS})
    except ValueError as e:
        raise InvalidLayout(f"layout: {e}") from e


def handoff_to_proto(handoff: KVHandoff, **fields: Any) -> pb.PrefillRequest:
    """The Prefill RPC for a handoff; `fields`: the request's other fields (prompt,
    sampling, kv_address, kv_token...)."""
    lora = None if handoff.lora is None else pb.LoRAAdapter(
        name=handoff.lora.lora_name, path=handoff.lora.lora_path, digest=handoff.lora_digest)
    return pb.PrefillRequest(request_id=handoff.request_id, dst_block_ids=handoff.block_ids,
                             first_block=handoff.first_block, layout=layout_to_proto(handoff.layout),
                             lora=lora, **fields)


def handoff_from_proto(msg: pb.PrefillRequest) -> KVHandoff:
    """InvalidLayout for a malformed layout; ValueError naming any other field that
    is invalid."""
    layout = layout_from_proto(msg.layout)
    lora, digest = lora_from_proto(msg.lora if msg.HasField("lora") else None)
    return KVHandoff(msg.request_id, tuple(msg.dst_block_ids), msg.first_block, layout,
                     lora=lora, lora_digest=digest or "")
