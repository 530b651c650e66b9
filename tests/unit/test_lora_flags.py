"""LoRA flags: `name=path` parsing, the config's checks, and `splitserve up`
handing the same adapters to the workers and the frontend, which parse them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.config import LoRAConfig
from engine.vocab.lora_request import LoRARequest, check_adapter, parse_lora_module
from services.frontend.config import build_parser as frontend_parser
from services.lora_flags import lora_argv, lora_config_from_args
from services.worker import add_worker_args
from tests.unit.test_launcher_flags import up_parser


def test_lora_module_form_and_names() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoRARequest("sql", "/adapters/sql")
    for bad, field in (("noequals", "--lora-modules"), ("=/p", "lora_name"), ("x=", "lora_path"),
                       ("bad name=/p", "lora_name")):
        with pytest.raises(ValueError, match=field):
            parse_lora_module(bad)


def test_config_checks() -> None:
    assert not LoRAConfig().enabled
    assert LoRAConfig(lora_modules=(LoRARequest("a", "/a"),)).enabled  # modules imply --enable-lora
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(max_loras=0)
    with pytest.raises(ValueError, match="max_loras is 1"):
        LoRAConfig(lora_modules=(LoRARequest("a", "/a"), LoRARequest("b", "/b")))
    with pytest.raises(ValueError, match="twice"):
        LoRAConfig(max_loras=2, lora_modules=(LoRARequest("a", "/a"), LoRARequest("a", "/b")))


def test_up_hands_the_adapters_to_workers_and_frontend() -> None:
    args = up_parser().parse_args(["--lora-modules", "a=/x/a", "b=/x/b", "--lora-modules", "c=/x/c",
                                   "--max-loras", "3", "--max-lora-rank", "32"])
    want = LoRAConfig(max_loras=3, max_lora_rank=32, lora_modules=(
        LoRARequest("a", "/x/a"), LoRARequest("b", "/x/b"), LoRARequest("c", "/x/c")))
    assert lora_config_from_args(args) == want
    worker = argparse.ArgumentParser()
    add_worker_args(worker, "decode")
    assert lora_config_from_args(worker.parse_args(lora_argv(args))) == want
    fe = frontend_parser().parse_args(["--decode", "127.0.0.1:1", *lora_argv(args)])
    assert lora_config_from_args(fe) == want
    assert not lora_config_from_args(up_parser().parse_args([])).enabled


def write_adapter(d: Path, config: dict[str, Any], names: list[str]) -> Path:
    from safetensors.numpy import save_file

    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(config))
    save_file({n: np.zeros((2, 2), np.float32) for n in names}, str(d / "adapter_model.safetensors"))
    return d


def test_adapters_are_checked_without_torch(tmp_path: Path) -> None:
    """What the frontend refuses before serving an adapter, each a ValueError naming lora_path."""
    good = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    check_adapter(write_adapter(tmp_path / "ok", {"r": 8, "lora_alpha": 16}, good), max_rank=8)
    for i, (config, names, message) in enumerate([
        ({"r": 16}, good, "exceeds --max-lora-rank 8"),
        ({"r": 8, "use_dora": True}, good, "use_dora"),
        ({"r": 8, "modules_to_save": ["lm_head"]}, good, "modules_to_save"),
        ({"r": 8}, ["base_model.model.lm_head.lora_A.weight"], "does not adapt"),
    ]):
        with pytest.raises(ValueError, match=f"lora_path: .*{message}"):
            check_adapter(write_adapter(tmp_path / str(i), config, names), max_rank=8)
    with pytest.raises(ValueError, match="lora_path: .* no adapter_config.json"):
        check_adapter(tmp_path / "missing", max_rank=8)
