"""Quantized checkpoints run through the CPU kernel's 4-bit blocks and compute
what their dequantized float32 weights compute.

AWQ and GPTQ checkpoints are made here from a tiny random model with the
reference packers of tests/quant_ref.py (int4, group size 128); GGUF files of
each type from a tiny Llama with a byte-level tokenizer.  The reference is
transformers in float32 over the dequantized weights: the engine generates its
greedy tokens, with every step's logits within 1e-3 (as the family tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.cpu_attention import load_cpu_kernel, load_linear_kernel
from tests.integration.test_hf_parity import LogitRecorder
from tests.integration.test_model_families import reference
from tests.quant_ref import pack_awq, pack_gptq, quantize_groups, write_tiny_gguf

TOLERANCE = 1e-3  # max abs logit difference from transformers over the dequantized weights
NEW_TOKENS = 12  # as test_model_families.reference generates

# kind -> (transformers config class, quant_method, quantization_config extras, quantizer options)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "awq": ("LlamaConfig", dict(quant_method="awq", version="gemm", zero_point=True), {}),
    # Original GPTQ format (zeros stored minus one), symmetric, Qwen2 (qkv biases).
    "gptq": ("Qwen2Config", dict(quant_method="gptq", sym=True, desc_act=False), dict(sym=True)),
    "gptq_v2": ("LlamaConfig", dict(quant_method="gptq", sym=False, desc_act=False,
                                    checkpoint_format="gptq_v2"), {}),
    # Act-order: groups scattered over the inputs, dequantized to float at load.
    "gptq_act_order": ("LlamaConfig", dict(quant_method="gptq", sym=False, desc_act=True),
                       dict(act_order=True, min_zero=1)),
}
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Conversions and packed weights go under tmp_path; the kernels, built
    (or loaded) first, stay the machine's."""
    assert load_linear_kernel() is not None and load_cpu_kernel() is not None
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))


def make_quantized(kind: str, out: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """-> (the quantized checkpoint, the same model with its weights dequantized to float32)."""
    import transformers
    from safetensors.torch import save_file

    cls_name, qc, opts = CHECKPOINTS[kind]
    config = getattr(transformers, cls_name)(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".bias"):
                continue
            if name.rsplit(".", 1)[-1] not in LINEAR_SUFFIXES:
                continue
            w = module.weight
            if getattr(module, "bias", None) is not None:
                module.bias.normal_(0, 0.5, generator=gen)
            k = w.shape[1]
            g_idx = None
            if opts.get("act_order"):
                g_idx = torch.empty(k, dtype=torch.int32)
                g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // 128).to(torch.int32)
            gq = quantize_groups(w, 128, sym=opts.get("sym", False), g_idx=g_idx,
                                 min_zero=opts.get("min_zero", 0))
            w.copy_(gq.dequantize())
            parts = pack_awq(gq) if qc["quant_method"] == "awq" else pack_gptq(
                gq, v1=qc.get("checkpoint_format", "gptq") == "gptq")
            packed.update({f"{name}.{s}": t for s, t in parts.items()})
    fdir, qdir = out / "float", out / "quantized"
    model.save_pretrained(fdir)
    qdir.mkdir(parents=True)
    def is_quantized(n: str) -> bool:
        return n.endswith(".weight") and n.rsplit(".", 2)[-2] in LINEAR_SUFFIXES

    state = {n: t.contiguous() for n, t in model.state_dict().items()
             if n != "lm_head.weight" and not is_quantized(n)}
    save_file({**state, **packed}, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fdir / "config.json").read_text())
    cfg["quantization_config"] = dict(bits=4, group_size=128, **qc)
    (qdir / "config.json").write_text(json.dumps(cfg))
    for d in (fdir, qdir):
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, d / f.name)
    return qdir, fdir


def check_engine(path: Path, float_dir: Path, prompt: list[int], label: str) -> LLM:
    """The engine over `path` generates what transformers over `float_dir`
    generates, every step's logits within TOLERANCE; -> the engine."""
    _, tokens, logits = reference(float_dir, prompt)
    llm = LLM(model=str(path), dtype="float32", num_blocks=64, num_threads=2)
    rec = LogitRecorder(llm)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS))
    assert out[0].outputs[0].token_ids == tokens
    diff = (torch.stack(rec.logits[f"{out[0].request_id}-0"]) - logits).abs().max().item()
    print(f"{label}: max abs logit difference {diff:.2e} over {NEW_TOKENS} steps")
    assert diff < TOLERANCE, f"max abs logit difference {diff}"
    return llm


@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_awq_gptq_checkpoint_runs_4_bit_and_matches_its_float_weights(kind, tmp_path, model_dir,  # type: ignore[no-untyped-def]
                                                                      private_cache) -> None:
    from safetensors.torch import load_file

    qdir, fdir = make_quantized(kind, tmp_path, model_dir)
    llm = check_engine(qdir, fdir, list(range(1000, 1060)), kind)
    model = llm.engine.runner.model
    floats = load_file(str(fdir / "model.safetensors"))
    for path, names in model.linear_sources().items():
        layer = model.get_submodule(path)
        dense = torch.cat([floats[n] for n in names])
        if kind == "gptq_act_order":  # no 4-bit form: float32 panels of the dequantized weights
            assert layer.q4 is None and torch.equal(layer.panels, layer.kernel.pack_weight(dense))
        else:  # the 4-bit blocks alone, and they hold exactly the dequantized weights
            assert layer.panels is None and layer.q4 is not None
            assert torch.equal(layer.kernel.q4_unpack(layer.q4, layer.out_features), dense)


def test_without_the_kernel_a_4_bit_checkpoint_loads_dequantized(tmp_path, model_dir, private_cache,  # type: ignore[no-untyped-def]
                                                                  monkeypatch) -> None:
    """Where the CPU kernel is not used (a GPU, bf16, no compiler), the layers
    get the dequantized float weights: the same model as the float checkpoint."""
    import engine.model_runner as model_runner

    qdir, fdir = make_quantized("awq", tmp_path, model_dir)
    monkeypatch.setattr(model_runner, "load_linear_kernel", lambda: None)
    quant, plain = (model_runner.load_model(d, torch.float32, torch.device("cpu")) for d in (qdir, fdir))
    assert isinstance(quant.layers[0].qkv_proj, torch.nn.Linear)
    for (name, a), (_, b) in zip(quant.state_dict().items(), plain.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_gguf_type_matches_its_dequantized_weights(qtype, tmp_path, private_cache) -> None:  # type: ignore[no-untyped-def]
    import gguf
    from safetensors.torch import load_file

    from engine.models.loader import resolve_model

    path = tmp_path / f"tiny-{qtype}.gguf"
    values = write_tiny_gguf(str(path), qtype)
    # gguf's dequantizer reads the blocks as the test's packer meant them
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type.name == qtype:
            assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type), values[t.name]), t.name
    model_dir = resolve_model(path)
    floats = load_file(str(model_dir / "model.safetensors"))
    down = floats["model.layers.1.mlp.down_proj.weight"].numpy()
    assert np.array_equal(down, values["blk.1.ffn_down.weight"])
    llm = check_engine(path, model_dir, list(range(40, 100)), qtype)
    model = llm.engine.runner.model
    four_bit = [p for p in model.linear_names() if model.get_submodule(p).q4 is not None]
    if qtype in ("Q4_0", "Q4_K"):  # every projection and the head decode from the file's blocks
        assert four_bit == model.linear_names()
        layer = model.layers[1].qkv_proj
        x = torch.randn(1, layer.in_features)
        assert torch.equal(layer(x), layer.kernel.q4_linear(x, layer.q4, layer.out_features, None))
        assert layer.panels is None  # the blocks alone
        panels = layer.kernel.pack_weight(layer.weight())
        torch.testing.assert_close(layer(x), layer.kernel.packed_linear(x, panels, layer.out_features),
                                   rtol=1e-5, atol=1e-5)
    else:  # no 4-bit form: float32 weights dequantized at load
        assert four_bit == []
