"""Any supported Hugging Face family directory loads: tiny random Llama (with
Llama 3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms; tied head;
all attention biases), Phi-3 (fused checkpoint, partial rope) models, and
Mistral and Phi-3 with a sliding window shorter than the prompt, Gemma 2
(soft caps) and Gemma 3 (q/k norms, local rope), saved with
transformers, generate exactly what transformers generates from them, with
every step's logits within 1e-3, before and after a prefix-cache hit."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from tests.integration.test_hf_parity import LogitRecorder

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False)
NEW_TOKENS = 12
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24, tie_word_embeddings=True,
             layer_types=["sliding_attention", "full_attention"])

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(rope_theta=10000.0, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(rope_theta=10000.0)),
    # head_dim apart from hidden / heads, as Qwen3 checkpoints have it; tied head.
    "qwen3": ("Qwen3Config", dict(rope_theta=1000000.0, head_dim=32, tie_word_embeddings=True)),
    "qwen3_bias": ("Qwen3Config", dict(rope_theta=10000.0, attention_bias=True)),
    # Fused qkv_proj / gate_up_proj in the checkpoint, rope on half of each head.
    "phi3": ("Phi3Config", dict(rope_theta=10000.0, partial_rotary_factor=0.5, pad_token_id=0)),
    # The prompt (90) and the decodes run past the window: it must be honoured.
    "mistral_window": ("MistralConfig", dict(rope_theta=10000.0, sliding_window=24)),
    "phi3_window": ("Phi3Config", dict(rope_theta=10000.0, sliding_window=40, pad_token_id=0)),
    # Alternating sliding / full layers, (1 + w) norms, sandwich norms, GELU,
    # query_pre_attn_scalar apart from head_dim; soft caps small enough to bite.
    "gemma2": ("Gemma2Config", dict(GEMMA, attn_logit_softcapping=0.05, final_logit_softcapping=0.2)),
    # q/k norms; sliding layers with their own rope base, full ones with linear scaling.
    "gemma3": ("Gemma3TextConfig", dict(GEMMA, rope_parameters=dict(
        sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0)))),
}
# Config changes that must change transformers' answer, so that matching it
# shows the feature was honoured.
MATTERS: dict[str, list[dict[str, Any]]] = {
    "mistral_window": [dict(sliding_window=None)],
    "phi3_window": [dict(sliding_window=None)],
    "gemma2": [dict(sliding_window=4096), dict(attn_logit_softcapping=None),
               dict(final_logit_softcapping=None)],
    "gemma3": [dict(sliding_window=4096), dict(rope_parameters=dict(  # one rope for all layers
        sliding_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
        full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0)))],
}


def make_model(kind: str, out: Path, tokenizer_dir: Path) -> Path:
    import transformers

    cls_name, extra = FAMILIES[kind]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights, so a missed one shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.normal_(1, 0.5)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def reference(path: Path, prompt: list[int], **kw: Any) -> tuple[Any, list[int], torch.Tensor]:
    """-> (the transformers model, its greedy tokens, its logits per step [N, V])."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return hf, out.sequences[0, len(prompt):].tolist(), torch.stack([x[0] for x in out.logits])


def check_engine(path: Path, prompt: list[int], tokens: list[int], logits: torch.Tensor,
                 **kw: Any) -> None:
    """Twice: the second run's prompt prefills after a prefix-cache hit, so
    the new tokens attend to cached keys."""
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, num_threads=2, **kw)
    rec = LogitRecorder(llm)
    for run in range(2):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                  min_tokens=NEW_TOKENS))
        assert out[0].outputs[0].token_ids == tokens
        assert (out[0].num_cached_tokens > 0) == (run == 1)
        mine = torch.stack(rec.logits[f"{out[0].request_id}-0"])
        assert mine.shape == logits.shape
        diff = (mine - logits).abs().max().item()
        assert diff < 1e-3, f"max abs logit difference {diff}"


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_family_matches_transformers(kind, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    path = make_model(kind, tmp_path / kind, model_dir)
    prompt = list(range(1000, 1090))  # past original_max_position_embeddings: scaling matters
    # Eager attention: transformers' own sliding-window mask, written out.
    hf, tokens, logits = reference(path, prompt, attn_implementation="eager")
    attn = hf.model.layers[0].self_attn
    if kind in ("qwen2", "qwen3_bias"):
        assert attn.q_proj.bias is not None
    if kind == "qwen3_bias":
        assert attn.o_proj.bias is not None
    if kind == "qwen3":
        assert attn.q_proj.bias is None and attn.q_norm is not None
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    if kind == "phi3":
        assert hf.model.layers[0].self_attn.qkv_proj is not None
    for change in MATTERS.get(kind, []):
        _, _, other = reference(path, prompt, attn_implementation="eager", **change)
        assert (other - logits).abs().max().item() > 1e-2, change
    check_engine(path, prompt, tokens, logits)


@pytest.mark.parametrize("kind", ["mistral_window", "gemma3"])
def test_family_split_matches_transformers(kind, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    """Across the split (prefill engine -> copied blocks -> decode engine), a
    windowed family still generates transformers' greedy tokens."""
    from tests.integration.test_engine_split import remote_generate

    path = make_model(kind, tmp_path / kind, model_dir)
    prefill, decode = (LLM(model=str(path), dtype="float32", num_blocks=64, block_size=8,
                           num_threads=2).engine for _ in range(2))
    prompt = " ".join(f"item {i} of the list is {i * 7 % 13}" for i in range(12))  # past the window
    ids = decode.tokenize(prompt)
    assert len(ids) > 2 * GEMMA["sliding_window"]  # type: ignore[operator]
    _, tokens, _ = reference(path, ids, attn_implementation="eager")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert remote_generate(prefill, decode, "split", prompt, params) == tokens


@pytest.mark.parametrize("kind", ["mistral_window", "gemma2"])
def test_family_triton_backend(kind, tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    """The Triton backend (the interpreter on CPUs) honours the window too;
    soft-capped attention (Gemma 2) falls back to the torch path there."""
    path = make_model(kind, tmp_path / kind, model_dir)
    prompt = list(range(1000, 1090))
    _, tokens, logits = reference(path, prompt, attn_implementation="eager")
    check_engine(path, prompt, tokens, logits, attention_backend="triton")
