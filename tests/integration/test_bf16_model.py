"""A bfloat16 model on a CPU whose packed kernels run bfloat16 (AVX512-BF16 or
AMX; model_runner.packed_bf16): its weights held as bfloat16 panels (and a
layer's 4-bit blocks), no float32 copy, activations and sums in float32.  Each
token is then computed exactly as a float32 model computes it under
--prefill-dtype bfloat16 --decode-dtype D with a bfloat16 KV cache, but for
the head's logits of a prompt's last token (bfloat16 panels, not float32).  D
is what the model's decode_dtype says: asked for, or by default bfloat16 (the
4-bit blocks exact, x rounded) on a CPU with AVX512-VBMI and no AMX, else
bfloat16-weights (the panels)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.packed_linear import PackedLinear
from tests.unit.test_linear_q4bf16 import needs_cpu as needs_q4bf16

from .procs import start_pair, stop_all
from .test_prefill_bf16 import BF16_CPU, _tokens_and_logprobs
from .test_workers import generate

needs_bf16 = pytest.mark.skipif(not BF16_CPU, reason="this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), "
                                                     "which a bfloat16 model's packed kernels need")

PROMPTS = ["The capital of France is", "def fib(n):\n    ", "Once upon a time, in a land far away, a"]


def _generate(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))
    return [_tokens_and_logprobs(o) for o in outs]


def _default_decodes() -> str:
    """What a bfloat16 model's generated tokens run on by default here (ModelRunner._bf16_model_decodes)."""
    from engine.layers.cpu_attention import load_linear_kernel

    kernel = load_linear_kernel()
    return "bfloat16" if kernel.q4bf16_supported() and not kernel.amx_supported() else "bfloat16-weights"


@needs_bf16
@pytest.mark.parametrize("decodes", ["auto", "bfloat16-weights",
                                     pytest.param("bfloat16", marks=needs_q4bf16)])
def test_bf16_model_holds_no_float32_weights_and_computes_as_float32_with_bf16_options(decodes: str) -> None:
    bf = LLM(dtype="bfloat16", num_blocks=96, num_threads=1, decode_dtype=decodes)
    runner = bf.engine.runner
    want = _default_decodes() if decodes == "auto" else decodes
    assert runner.bf16_weights_model
    assert (runner.model_dtype, runner.dtype) == (torch.bfloat16, torch.float32)  # weights, activations
    assert (runner.prefill_dtype, runner.decode_dtype, runner.kv_cache.dtype) == (
        "bfloat16", want, torch.bfloat16)
    for path in runner.model.linear_names():
        layer = runner.model.get_submodule(path)
        assert isinstance(layer, PackedLinear), path
        # prompt rows on the bfloat16 panels (the head's too), the others on those or the blocks:
        # no float32 copy held
        assert layer.bf16 is not None and layer.panels is None and layer.bf16_prompts, path
        assert layer.bf16_weights == (want == "bfloat16-weights"), path
        assert layer.bf16_decodes == (want == "bfloat16"), path
    f32 = LLM(dtype="float32", num_blocks=96, num_threads=1, prefill_dtype="bfloat16",
              decode_dtype=want, kv_cache_dtype="bfloat16")
    assert bf.engine.kv_layout == f32.engine.kv_layout  # the same prompt blocks: pairs with such a worker
    # the head's weight is the float32 one rounded to bfloat16, read back from its panels
    head, ref = runner.model.lm_head, f32.engine.runner.model.lm_head
    assert ref.panels is not None  # there the head's prompt rows stay float32
    assert torch.equal(head.weight(), ref.weight().bfloat16().float())
    got, want_out = _generate(bf, PROMPTS), _generate(f32, PROMPTS)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want_out, strict=True):
        assert tokens == ref_tokens
        assert lps[1:] == ref_lps[1:]  # every decode the same bits
        # the first token's logits: the head on bfloat16 panels here, float32 there
        assert 0 < abs(lps[0] - ref_lps[0]) < 0.05
    # a prompt alone gives what it gave among the others: a row's result never depends on its batch
    assert [_generate(bf, [p])[0] for p in PROMPTS] == got


@needs_bf16
def test_bf16_panels_are_kept_for_the_next_start(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The bfloat16 panels a start packs are saved beside the packed weights
    and mapped from the file by the next start that holds bfloat16 panels;
    a start that needs more panels than the file has adds them; one that
    holds none keeps none; a bad file is packed again."""
    import engine.model_runner as model_runner

    path = tmp_path / "bf16.pt"
    monkeypatch.setattr(model_runner, "bf16_panels_path", lambda *_: path)

    def names(llm: LLM) -> set[str]:
        return set(llm.engine.runner.model.bf16_panels())

    first = LLM(dtype="float32", num_blocks=16, num_threads=1, prefill_dtype="bfloat16")
    projections = {p for p in first.engine.runner.model.linear_names() if p != "lm_head"}
    assert names(first) == projections  # the head's prompt rows stay float32 there
    saved = model_runner.load_packed(path)
    assert saved is not None and set(saved) == projections
    # the next start takes the file's panels: one changed on disk is what it holds
    marked = {k: v.clone() for k, v in saved.items()}
    marked["layers.3.o_proj"].view(torch.int16)[0, 0, 0, 0] ^= 1
    torch.save(marked, path)
    second = LLM(dtype="float32", num_blocks=16, num_threads=1, prefill_dtype="bfloat16")
    assert torch.equal(second.engine.runner.model.layers[3].o_proj.bf16, marked["layers.3.o_proj"])
    # a bfloat16 model also holds the head's: packed here, added to the file
    bf = LLM(dtype="bfloat16", num_blocks=16, num_threads=1)
    assert names(bf) == projections | {"lm_head"}
    saved = model_runner.load_packed(path)
    assert saved is not None and set(saved) == projections | {"lm_head"}
    assert torch.equal(saved["layers.3.o_proj"], marked["layers.3.o_proj"])
    # a float32 model without bfloat16 options holds none of them
    assert names(LLM(dtype="float32", num_blocks=16, num_threads=1)) == set()
    path.write_bytes(b"not a torch file")
    again = LLM(dtype="float32", num_blocks=16, num_threads=1, prefill_dtype="bfloat16")
    assert torch.equal(again.engine.runner.model.layers[3].o_proj.bf16,
                       first.engine.runner.model.layers[3].o_proj.bf16)
    assert model_runner.load_packed(path) is not None  # rewritten


@pytest.fixture(scope="module")
def pair(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A prefill worker of a bfloat16 model and a decode worker of a float32
    model whose tokens all run in bfloat16, generated ones as the bfloat16
    model's do (every prompt sent to the prefill worker)."""
    if not BF16_CPU:
        pytest.skip("this CPU lacks AVX512-BF16 (lscpu: no avx512_bf16), which a bfloat16 model's "
                    "packed kernels need")
    p, d = start_pair(tmp_path_factory.mktemp("bf16-model"), ["--num-blocks", "64", "--dtype", "bfloat16"],
                      ["--num-blocks", "64", "--dtype", "float32", "--prefill-dtype", "bfloat16",
                       "--decode-dtype", _default_decodes(), "--kv-cache-dtype", "bfloat16",
                       "--local-prefill-threshold", "1"])
    try:
        yield p, d
    finally:
        stop_all([p, d])


def test_split_with_a_float32_decode_worker_equals_one_bf16_engine(pair) -> None:  # type: ignore[no-untyped-def]
    """The two kinds of worker compute a prompt's blocks alike, so their layouts
    pair; the prefill worker samples the first token (its bfloat16 head), the
    decode worker the rest as the bfloat16 model does."""
    p, d = pair
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(dtype="bfloat16", num_blocks=64, num_threads=1, max_model_len=1024)
    ids = one.tokenizer.encode(PROMPTS[2])
    chunks = generate(d.address, p.address, "bf16-split", ids, params)
    assert chunks[0].remote_prefill and chunks[0].cached_tokens == 0
    assert [t for c in chunks for t in c.token_ids] == one.generate(ids, params)[0].outputs[0].token_ids
