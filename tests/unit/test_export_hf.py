"""`splitserve export-hf`: the config fields other readers need.  (The export
itself, loaded by transformers, is tested in tests/integration/test_bench_serve.py.)"""

from __future__ import annotations

import pytest

from services.export_hf import export_hf, normalize_config, normalize_tokenizer_config

GGUF_CONFIG = {"architectures": None, "model_type": "llama", "dtype": "float32",
               "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


def test_config_gets_architecture_dtype_and_legacy_rope() -> None:
    out = normalize_config(GGUF_CONFIG, "LlamaForCausalLM", "bfloat16")
    assert out["architectures"] == ["LlamaForCausalLM"]
    assert out["dtype"] == out["torch_dtype"] == "bfloat16"
    assert out["rope_theta"] == 100000.0 and "rope_scaling" not in out
    assert GGUF_CONFIG["architectures"] is None  # the input is not changed
    kept = normalize_config({**GGUF_CONFIG, "architectures": ["MyLlama"], "rope_theta": 5.0}, "X", "float32")
    assert kept["architectures"] == ["MyLlama"] and kept["rope_theta"] == 5.0
    scaled = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    assert normalize_config({"rope_parameters": scaled}, "X", "float32")["rope_scaling"] == scaled


def test_tokenizer_config_names_a_class_old_readers_know() -> None:
    cfg = {"tokenizer_class": "TokenizersBackend", "eos_token": "<e>"}
    out = normalize_tokenizer_config(cfg, "{{ messages }}")
    assert out == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<e>",
                   "chat_template": "{{ messages }}"}
    own = {"tokenizer_class": "LlamaTokenizerFast", "chat_template": "mine"}
    assert normalize_tokenizer_config(own, "other") == own


def test_refuses_a_non_empty_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        export_hf(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        export_hf(tmp_path / "new", dtype="int8")
