"""LoRA flags (vLLM's), shared by the workers, the frontend and `splitserve up`.
Torch-free: the frontend and the launcher parse them without the engine."""

from __future__ import annotations

import argparse
from typing import Any

from engine.vocab.lora_request import LoRAConfig, LoRARequest, parse_lora_module


def lora_module(value: str) -> LoRARequest:
    try:
        return parse_lora_module(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: requests name one as their `model`; "
                        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time")
    g.add_argument("--lora-modules", type=lora_module, nargs="+", action="extend", default=[],
                   metavar="NAME=PATH",
                   help="adapters served from the start (PEFT directories every worker can read); "
                        "implies --enable-lora; repeatable")
    g.add_argument("--max-loras", type=int, default=1, help="LoRA adapters held at once")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank accepted")


def lora_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA flags as `engine_config(...)` / LoRAConfig keywords."""
    return dict(enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                lora_modules=tuple(args.lora_modules))


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig:
    """Raises ValueError naming the field."""
    return LoRAConfig(**lora_kwargs(args))


def lora_argv(args: argparse.Namespace) -> list[str]:
    """The flags again, for a process `up` starts."""
    out = ["--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
    if args.enable_lora:
        out.append("--enable-lora")
    for m in args.lora_modules:
        out += ["--lora-modules", f"{m.lora_name}={m.lora_path}"]
    return out
