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
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What a name may look like: it is a `model` value in the API.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# PEFT's weight names: ...layers.{i}.self_attn.q_proj.lora_A.weight
KEY_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj",
                     "gate_up_proj", "down_proj"})


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


def check_adapter_config(cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """-> (rank, scale).  Refuses what the engine would silently get wrong."""
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"lora_path: adapter_config.json has no valid rank r ({r!r})")
    if r > max_rank:
        raise ValueError(f"lora_path: the adapter's rank {r} exceeds --max-lora-rank {max_rank}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if cfg.get(key, ok) not in (ok, None):
            raise ValueError(f"lora_path: {key}={cfg[key]!r} is not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"lora_path: {key} is not supported")
    alpha = cfg.get("lora_alpha", r)
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def check_adapter(path: str | Path, max_rank: int) -> None:
    """What can be checked without torch (the frontend, before it serves an
    adapter): its config, and that every weight adapts a projection the
    engine adapts (read from the safetensors header)."""
    cfg, weights = adapter_files(path)
    try:
        check_adapter_config(json.loads(cfg.read_text()), max_rank)
        with weights.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, struct.error) as e:
        raise ValueError(f"lora_path: unreadable adapter files ({e})") from None
    for name in names:
        m = KEY_RE.search(name)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(f"lora_path: adapter weight {name!r} targets a module this engine does not "
                             f"adapt (it adapts {', '.join(sorted(TARGETS))})")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's flags).  enable_lora: requests may name adapters,
    loaded at run time; lora_modules are loaded at start-up (and imply it)."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters held at once; the least recently used goes first
    max_lora_rank: int = 16
    lora_modules: tuple[LoRARequest, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        names = [m.lora_name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError("lora_modules: an adapter name is given twice")
        if len(names) > self.max_loras:
            raise ValueError(f"lora_modules: {len(names)} adapters, max_loras is {self.max_loras}")

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)
