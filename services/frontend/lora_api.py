"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's shapes
(behind the API key like every v1 path)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from engine.vocab.lora_request import LoRARequest
from services.frontend.core import Frontend
from services.frontend.errors import from_value_error
from services.frontend.loras import entry
from services.frontend.protocol import parse_body


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    lora_name: str


async def load_lora_adapter(fe: Frontend, body: bytes) -> str:
    req = parse_body(body, LoadLoRAAdapterRequest)
    try:
        lora = LoRARequest(req.lora_name, req.lora_path)
    except ValueError as e:
        raise from_value_error(e) from None
    fe.loras.check_new(lora, fe.model_name)
    found = await fe.off_loop(entry, lora, fe.loras.max_rank)  # reads the adapter's files for its digest
    fe.loras.check_new(lora, fe.model_name)  # a load of the same name may have finished meanwhile
    fe.loras.add(found)
    return f"Success: LoRA adapter '{lora.lora_name}' added successfully."


def unload_lora_adapter(fe: Frontend, body: bytes) -> str:
    req = parse_body(body, UnloadLoRAAdapterRequest)
    fe.loras.remove(req.lora_name)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
