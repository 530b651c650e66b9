"""Flags -> EngineConfig in one place (engine.config.engine_config), with the
defaults written once (the config dataclasses): the worker flags, `LLM(...)`
and the dataclasses agree; and the fault-injection seam is off unless a test
names its plugin."""

from __future__ import annotations

import inspect

import pytest

from engine.config import EngineConfig, engine_config
from services.decode.__main__ import parse as parse_decode
from services.fault_hooks import ENV, load_fault_hooks
from services.prefill.__main__ import parse as parse_prefill
from services.worker_flags import PREFILL_WORKER_MAX_NUM_BATCHED_TOKENS, worker_engine_config


def test_worker_defaults_are_the_config_defaults() -> None:
    for parse in (parse_prefill, parse_decode):
        config = worker_engine_config(parse([]))
        # but a prefill worker's steps: smaller, so its first prompts finish sooner
        steps = PREFILL_WORKER_MAX_NUM_BATCHED_TOKENS if parse is parse_prefill else None
        assert config == engine_config(**({"max_num_batched_tokens": steps} if steps else {}))
        default = EngineConfig()  # the dataclasses' own, but for the uncapped max_model_len
        assert (config.model, config.cache, config.speculative) == (default.model, default.cache,
                                                                   default.speculative)


def test_llm_defaults_are_the_config_defaults() -> None:
    from engine.llm import LLM

    llm_params = inspect.signature(LLM.__init__).parameters
    config_params = inspect.signature(engine_config).parameters
    # Adapters served from the start are a worker flag; the offline API takes one per request.
    assert set(llm_params) - {"self"} == set(config_params) - {"lora_modules"}
    for name, p in config_params.items():
        if name == "lora_modules":
            continue
        assert llm_params[name].default == p.default, name


def test_flags_reach_the_config() -> None:
    args = parse_decode(["--block-size", "32", "--num-blocks", "99", "--max-model-len", "512",
                         "--no-prefix-caching", "--scheduling-policy", "priority",
                         "--speculative-method", "ngram", "--num-speculative-tokens", "3"])
    c = worker_engine_config(args)
    assert (c.cache.block_size, c.cache.num_blocks, c.cache.enable_prefix_caching) == (32, 99, False)
    assert (c.scheduler.max_model_len, c.scheduler.policy) == (512, "priority")
    assert (c.speculative.method, c.speculative.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(ValueError, match="block_size"):
        worker_engine_config(parse_decode(["--block-size", "3"]))


def test_no_hidden_fault_flags() -> None:
    for parse in (parse_prefill, parse_decode):
        for flag in ("--fault-send-delay", "--fault-engine-crash-file", "--fault-step-fail-file"):
            with pytest.raises(SystemExit):
                parse([flag, "1"])


def test_fault_seam_is_off_unless_a_plugin_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = load_fault_hooks("prefill", {})
    assert (hooks.engine_iteration, hooks.before_step, hooks.before_kv_send) == (None, None, None)
    with pytest.raises(ValueError, match=ENV):
        load_fault_hooks("prefill", {ENV: "tests.faults"})
    from tests.faults import SEND_DELAY, fault_env

    monkeypatch.setenv(SEND_DELAY, "2")
    hooks = load_fault_hooks("prefill", fault_env(send_delay=2))
    assert hooks.before_kv_send is not None and hooks.engine_iteration is None
    assert load_fault_hooks("decode", fault_env(send_delay=2)).before_kv_send is None  # prefill only

