"""LoRA flags: `name=path` parsing, the config's checks, and `splitserve up`
handing the same adapters to the workers and the frontend, which parse them."""

from __future__ import annotations

import argparse

import pytest

from engine.config import LoRAConfig
from engine.lora_request import LoRARequest, parse_lora_module
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
    fe = frontend_parser().parse_args(["--decode", "127.0.0.1:1", *lora_argv(args, rank=False)])
    assert lora_config_from_args(fe).lora_modules == want.lora_modules and fe.max_loras == 3
    assert not lora_config_from_args(up_parser().parse_args([])).enabled
