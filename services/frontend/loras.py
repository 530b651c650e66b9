"""The LoRA adapters this frontend serves by name (a request's `model`).

Requests carry the adapter's name, path and digest to the workers, which load
it from the path on first use (services/convert.py, engine/lora.py): a worker
that restarts or joins later needs no separate load call.  A request keeps the
entry it was planned with, so unloading an adapter ends no request in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.vocab.lora_request import LoRAConfig, LoRARequest, adapter_digest, check_adapter
from protos import pb
from services.frontend.errors import APIError, bad_request


@dataclass(frozen=True)
class LoRAEntry:
    name: str
    path: str
    digest: str  # also the adapter's key in block hashes (engine.vocab.hashing.extra_keys)

    def to_proto(self) -> pb.LoRAAdapter:
        return pb.LoRAAdapter(name=self.name, path=self.path, digest=self.digest)


class LoRARegistry:
    def __init__(self, config: LoRAConfig) -> None:
        self.enabled = config.enabled
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.adapters: dict[str, LoRAEntry] = {}
        for m in config.lora_modules:
            try:
                self.adapters[m.lora_name] = entry(m, self.max_rank)
            except APIError as e:  # at start-up: a flag's error, not a request's
                raise ValueError(f"--lora-modules {m.lora_name}: {e.message}") from None

    def get(self, name: str | None) -> LoRAEntry | None:
        return self.adapters.get(name) if name else None

    def check_new(self, req: LoRARequest, base_model: str) -> None:
        """Before the digest is read: the errors vLLM gives, as 400s naming the field."""
        if not self.enabled:
            raise APIError(400, "LoRA is not enabled on this server (--enable-lora)", "lora_name")
        if req.lora_name in self.adapters or req.lora_name == base_model:
            raise bad_request(f"the adapter {req.lora_name!r} has already been loaded", "lora_name")
        if len(self.adapters) >= self.max_loras:
            raise bad_request(f"{len(self.adapters)} adapters are loaded, --max-loras is {self.max_loras}; "
                              f"unload one first", "lora_name")

    def add(self, e: LoRAEntry) -> None:
        self.adapters[e.name] = e

    def remove(self, name: str) -> None:
        if not self.enabled:
            raise APIError(400, "LoRA is not enabled on this server (--enable-lora)", "lora_name")
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"lora_name: the adapter {name!r} cannot be found", "lora_name",
                           "model_not_found")

    def cards(self, base_model: str, created: int) -> list[dict[str, Any]]:
        """/v1/models entries, as vLLM lists adapters (root: the path, parent: the base)."""
        return [{"id": e.name, "object": "model", "created": created, "owned_by": "splitserve",
                 "root": e.path, "parent": base_model} for e in self.adapters.values()]


def entry(req: LoRARequest, max_rank: int) -> LoRAEntry:
    """Reads and checks the adapter's files (off the event loop when serving);
    a 400 naming lora_path."""
    try:
        check_adapter(req.lora_path, max_rank)
        return LoRAEntry(req.lora_name, req.lora_path, adapter_digest(req.lora_path))
    except (ValueError, OSError) as e:
        raise bad_request(str(e).removeprefix("lora_path: "), "lora_path") from None
