"""Any Hugging Face Llama-family directory loads: tiny random Llama (with
Llama 3 rope scaling), Mistral and Qwen2 (qkv bias) models, saved with
transformers, generate exactly what transformers generates from them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False)

FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(rope_theta=10000.0, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(rope_theta=10000.0)),
}


def make_model(kind: str, out: Path, tokenizer_dir: Path) -> Path:
    import transformers

    cls_name, extra = FAMILIES[kind]
    config = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases, so a missed bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_family_matches_transformers(kind, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    import transformers

    path = make_model(kind, tmp_path / kind, model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if kind == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
    prompt = list(range(1000, 1090))  # past original_max_position_embeddings: scaling matters
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, num_threads=2)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=12))
    assert out[0].outputs[0].token_ids == ref
