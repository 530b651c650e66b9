"""LlamaSpec.from_hf: which features a config.json turns on, and clear
refusals for the ones the engine does not run."""

from __future__ import annotations

from typing import Any

import pytest

from engine.models.spec import LlamaSpec

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)


def spec(**cfg: Any) -> LlamaSpec:
    return LlamaSpec.from_hf({**BASE, **cfg})


def test_mistral_window_on_every_layer() -> None:
    s = spec(model_type="mistral", sliding_window=32)
    assert [s.window(i) for i in range(4)] == [32] * 4
    assert spec(model_type="mistral", sliding_window=None).layer_windows == ()


def test_layer_types_choose_the_windowed_layers() -> None:
    types = ["sliding_attention", "full_attention"] * 2
    s = spec(model_type="qwen3", sliding_window=8, layer_types=types)
    assert [s.window(i) for i in range(4)] == [8, None, 8, None]
    with pytest.raises(ValueError, match="layer_types"):
        spec(model_type="qwen3", sliding_window=8, layer_types=types[:3])
    with pytest.raises(ValueError, match="sliding_window"):
        spec(model_type="qwen3", sliding_window=None, layer_types=types)


def test_qwen2_window_only_when_used() -> None:
    assert spec(model_type="qwen2", sliding_window=4096, use_sliding_window=False).layer_windows == ()
    s = spec(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=2)
    assert [s.window(i) for i in range(4)] == [None, None, 16, 16]


def test_family_features() -> None:
    qwen3 = spec(model_type="qwen3", head_dim=32, attention_bias=False)
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    biased = spec(model_type="qwen3", attention_bias=True)
    assert biased.qkv_bias and biased.o_bias
    qwen2 = spec(model_type="qwen2")
    assert qwen2.qkv_bias and not qwen2.o_bias
    phi3 = spec(model_type="phi3", rope_parameters=dict(rope_type="default", partial_rotary_factor=0.5))
    assert phi3.fused_checkpoint and phi3.rope_dim == 8 and not phi3.qkv_bias


def test_refusals_name_the_field() -> None:
    with pytest.raises(ValueError, match="longrope.*rope_type"):
        spec(model_type="phi3", rope_scaling=dict(type="longrope", short_factor=[1.0], long_factor=[1.0]))
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        spec(model_type="gpt2")
    with pytest.raises(ValueError, match="sliding_window"):
        spec(model_type="mistral", sliding_window=-4)


def test_gemma_configs_saved_before_layer_types() -> None:
    """Older config.json files: the window pattern and local rope base by name."""
    g2 = spec(model_type="gemma2", sliding_window=16, query_pre_attn_scalar=24,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              hidden_activation="gelu_pytorch_tanh")
    assert [g2.window(i) for i in range(4)] == [16, None, 16, None]
    assert g2.gemma_norms and not g2.fusable and g2.attn_scale == 24 ** -0.5
    assert (g2.attn_softcap, g2.final_softcap, g2.local_rope_theta) == (50.0, 30.0, None)
    g3 = spec(model_type="gemma3_text", sliding_window=16, sliding_window_pattern=3,
              query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4,
              rope_scaling=dict(rope_type="linear", factor=8.0), hidden_activation="gelu_pytorch_tanh")
    assert [g3.window(i) for i in range(4)] == [16, 16, None, 16]
    assert g3.qk_norm and g3.rope_theta == 1e6 and g3.local_rope_theta == 1e4
    assert g3.rope_scaling is not None and g3.rope_scaling["factor"] == 8.0


def test_unknown_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        spec(model_type="llama", hidden_act="relu")
