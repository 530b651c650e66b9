"""LoRA against PEFT: two adapters made in the test (one on all seven
projections, one rank-stabilised on q/v only) and the base model, in one
batch of a tiny random Llama, each generate PEFT's greedy tokens with every
step's logits within 1e-3; the prefix cache shares no block across adapters
or with the base; adapters load and unload at run time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.integration.test_hf_parity import LogitRecorder
from tests.integration.test_model_families import make_model
from tests.unit.test_lora_flags import write_adapter

NEW_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def make_adapter(base: Path, out: Path, seed: int, std: float = 0.2, **config: Any) -> Path:
    """A PEFT adapter with random A and B (PEFT's default B is zero: no effect)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(out)
    return out


def reference(base: Path, adapter: Path | None, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """PEFT's (or, without an adapter, transformers') greedy tokens and logits [N, V]."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.inference_mode():
        out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([x[0] for x in out.logits])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("lora")
    base = make_model("llama3", root / "base", model_dir)
    adapters = {name: make_adapter(base, root / name, i, **cfg)
                for i, (name, cfg) in enumerate(ADAPTERS.items())}
    return base, adapters


def test_two_adapters_and_base_in_one_batch_match_peft(tiny) -> None:  # type: ignore[no-untyped-def]
    base, adapters = tiny
    prompt = list(range(1000, 1040))
    refs = {name: reference(base, path, prompt) for name, path in [("base", None), *adapters.items()]}
    assert refs["all"][0] != refs["base"][0] and refs["qv"][0] != refs["base"][0]  # the adapters matter
    llm = LLM(model=str(base), dtype="float32", num_blocks=64, num_threads=2, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    rec = LogitRecorder(llm)
    loras = [None, *(LoRARequest(name, str(path)) for name, path in adapters.items())]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for run in range(2):  # the second run prefills after a prefix-cache hit per adapter
        outs = llm.generate([prompt] * 3, params, lora_request=loras)
        for out, name in zip(outs, ["base", *adapters], strict=True):
            tokens, logits = refs[name]
            assert out.outputs[0].token_ids == tokens, name
            mine = torch.stack(rec.logits[f"{out.request_id}-0"])
            diff = (mine - logits).abs().max().item()
            assert diff < 1e-3, f"{name}: max abs logit difference {diff}"
            if run == 1:
                assert out.num_cached_tokens > 0, name


def test_prefix_cache_keys_blocks_by_adapter(tiny) -> None:  # type: ignore[no-untyped-def]
    """The same prompt under another adapter (or the base) hits nothing."""
    base, adapters = tiny
    llm = LLM(model=str(base), dtype="float32", num_blocks=64, num_threads=2, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    prompt = list(range(2000, 2040))
    params = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate(prompt, params)[0].num_cached_tokens == 0
    for name, path in adapters.items():
        out = llm.generate(prompt, params, lora_request=LoRARequest(name, str(path)))[0]
        assert out.num_cached_tokens == 0, name
        again = llm.generate(prompt, params, lora_request=LoRARequest(name, str(path)))[0]
        assert again.num_cached_tokens == 32, name  # two full blocks of its own
    assert llm.generate(prompt, params)[0].num_cached_tokens == 32


def test_a_new_adapter_version_shares_no_block(tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The adapter's digest (config and weights), not its name or path, keys its
    blocks: new weights written over the same path, reloaded under the same
    name, hit none of the old version's blocks, and a caller that expects the
    old digest (a decode worker's, sent to a prefill worker) is refused."""
    base, _ = tiny
    path = make_adapter(base, tmp_path / "ad", 7, **ADAPTERS["qv"])
    llm = LLM(model=str(base), dtype="float32", num_blocks=64, num_threads=2, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    eng, lora = llm.engine, LoRARequest("ad", str(path))
    old = eng.load_lora(lora)
    prompt, params = list(range(3000, 3040)), SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, lora_request=lora)
    assert llm.generate(prompt, params, lora_request=lora)[0].num_cached_tokens == 32
    make_adapter(base, path, 8, **ADAPTERS["qv"])  # version 2, same name and path
    new = eng.load_lora(lora)
    assert new != old
    assert llm.generate(prompt, params, lora_request=lora)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match=f"has digest {new}, the caller's has {old}"):
        eng.lora_adapter(lora, old)


def test_load_unload_and_errors(tiny, tmp_path) -> None:  # type: ignore[no-untyped-def]
    base, adapters = tiny
    llm = LLM(model=str(base), dtype="float32", num_blocks=64, num_threads=2, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    eng = llm.engine
    eng.load_lora(LoRARequest("all", str(adapters["all"])))
    assert eng.lora_names() == ["all"]
    eng.load_lora(LoRARequest("qv", str(adapters["qv"])))  # max_loras 1: "all" is evicted
    assert eng.lora_names() == ["qv"]
    assert eng.unload_lora("qv") and not eng.unload_lora("qv")
    assert eng.lora_names() == []
    with pytest.raises(ValueError, match="lora_path"):
        eng.load_lora(LoRARequest("missing", str(tmp_path / "nothing")))
    # Another model's adapter (2 x 2 matrices) is refused at load, never in a step.
    other = write_adapter(tmp_path / "other", {"r": 2}, [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])
    with pytest.raises(ValueError, match="lora_path: .*another model"):
        llm.generate([1, 2, 3], lora_request=LoRARequest("other", str(other)))
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving
    small = LLM(model=str(base), dtype="float32", num_blocks=16, num_threads=2, enable_lora=True,
                max_lora_rank=4)
    with pytest.raises(ValueError, match="max-lora-rank"):
        small.engine.load_lora(LoRARequest("all", str(adapters["all"])))
    plain = LLM(model=str(base), dtype="float32", num_blocks=16, num_threads=2)
    with pytest.raises(ValueError, match="model: 'qv'"):
        plain.generate([1, 2, 3], lora_request=LoRARequest("qv", str(adapters["qv"])))


def test_adapters_with_speculative_decoding(tiny) -> None:  # type: ignore[no-untyped-def]
    """Layer-skip drafts come from the base layers (no adapter); verification
    runs several rows per request with its adapter: PEFT's tokens still."""
    base, adapters = tiny
    prompt = list(range(3000, 3030))
    refs = {name: reference(base, path, prompt)[0] for name, path in [("base", None), *adapters.items()]}
    llm = LLM(model=str(base), dtype="float32", num_blocks=64, num_threads=2, enable_lora=True,
              max_loras=2, max_lora_rank=8,
              speculative_config={"method": "layerskip", "num_layers": 1, "num_speculative_tokens": 3,
                                  "adaptive": False})
    verified = []
    inner = llm.engine.runner.forward_logits

    def spy(seqs):  # type: ignore[no-untyped-def]
        verified.extend(len(s.spec_token_ids) for s in seqs)
        return inner(seqs)

    llm.engine.runner.forward_logits = spy  # type: ignore[method-assign]
    loras = [None, *(LoRARequest(name, str(path)) for name, path in adapters.items())]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate([prompt] * 3, params, lora_request=loras)
    assert max(verified) == 3  # drafts were verified
    for out, name in zip(outs, ["base", *adapters], strict=True):
        assert out.outputs[0].token_ids == refs[name], name


def test_fused_checkpoint_family_matches_peft(tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    """Phi-3: PEFT adapts its fused qkv_proj / gate_up_proj, and its partial
    rope runs the layers' unfused (torch) path."""
    base = make_model("phi3", tmp_path / "phi3", model_dir)
    path = make_adapter(base, tmp_path / "phi3-lora", 7, r=4, lora_alpha=8,
                        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    prompt = list(range(500, 540))
    tokens, logits = reference(base, path, prompt)
    assert tokens != reference(base, None, prompt)[0]
    llm = LLM(model=str(base), dtype="float32", num_blocks=64, num_threads=2, enable_lora=True,
              max_lora_rank=4)
    assert llm.engine.runner.model.fused is None  # the torch path
    rec = LogitRecorder(llm)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),
                       lora_request=LoRARequest("phi", str(path)))[0]
    assert out.outputs[0].token_ids == tokens
    diff = (torch.stack(rec.logits[f"{out.request_id}-0"]) - logits).abs().max().item()
    assert diff < 1e-3, f"max abs logit difference {diff}"
