"""LoRA adapters by name: what a request asks for, the flag's `name=path`
form, and an adapter's digest.  Torch-free (the frontend imports it).

An adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors)
on a path every worker can read.  Requests carry the name and the path, never
the weights: adapters are megabytes, prompts are kilobytes, and a worker that
restarts or joins later still finds the adapter.  The digest (of the config
and the weights) is the adapter's identity in block hashes, so no KV block is
shared across adapters or with the base model, and a prefill worker whose
copy differs from the decode worker's refuses instead of sending wrong KV.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What a name may look like: it is a `model` value in the API.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape, less the integer id (the name identifies an adapter here)."""

    lora_name: str
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not NAME_RE.match(self.lora_name):
            raise ValueError(f"lora_name: {self.lora_name!r} must be 1-128 letters, digits or ._:/- "
                             f"starting with a letter or digit")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path: must be a non-empty path")


def parse_lora_module(text: str) -> LoRARequest:
    """`name=path` (the --lora-modules flag's form, as vLLM's)."""
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora-modules: expected name=path, got {text!r}")
    return LoRARequest(name.strip(), path.strip())


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """The adapter's config and weights; ValueError naming lora_path when missing."""
    d = Path(path)
    cfg, weights = d / CONFIG_FILE, d / WEIGHTS_FILE
    if not cfg.is_file() or not weights.is_file():
        raise ValueError(f"lora_path: {str(path)!r} has no {CONFIG_FILE} and {WEIGHTS_FILE} "
                         f"(a PEFT adapter directory)")
    return cfg, weights


def adapter_digest(path: str | Path) -> str:
    """sha256 (first 32 hex digits) of the adapter's config and weights."""
    h = hashlib.sha256()
    for f in adapter_files(path):
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]
