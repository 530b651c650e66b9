"""4-bit weight formats read into the CPU kernel's blocks: AWQ and GPTQ packing
(against the reference packers in tests/quant_ref.py), GGUF Q4_0/Q4_1/Q4_K
blocks (against gguf's own dequantizer), and the kernel computing from those
blocks exactly what it computes from the dequantized float32 weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.layers.cpu_attention import load_linear_kernel
from engine.models.awq_gptq import awq_weight, gptq_weight, quant_method, unpack_int32
from engine.models.gguf_int4 import decode, llama_qk_order
from engine.models.int4 import Int4Weight, exact_blocks, pack_blocks
from tests.quant_ref import pack_awq, pack_gptq, quantize, quantize_groups


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    k = load_linear_kernel()
    assert k is not None, "the linear kernel must build on this machine"
    return k


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group", [128, 64, 32])
def test_awq_reads_back_what_was_packed(group: int) -> None:
    gq = quantize_groups(weight(48, 256, group), group)
    p = pack_awq(gq)
    w = awq_weight(p["qweight"], p["qzeros"], p["scales"])
    assert torch.equal(w.dequantize(), gq.dequantize())
    # the interleaved order matters: read in plain order, the columns come out wrong
    assert not torch.equal(unpack_int32(p["qweight"], dim=1), gq.q.t().to(torch.uint8))


@pytest.mark.parametrize("v1,sym", [(True, True), (True, False), (False, False)])
def test_gptq_reads_back_what_was_packed(v1: bool, sym: bool) -> None:
    gq = quantize_groups(weight(40, 384, 7), 128, sym=sym, min_zero=1 if v1 else 0)
    p = pack_gptq(gq, v1)
    w = gptq_weight(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], 1 if v1 else 0)
    assert isinstance(w, Int4Weight)
    assert torch.equal(w.dequantize(), gq.dequantize())
    other = gptq_weight(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], 0 if v1 else 1)  # zero convention
    assert isinstance(other, Int4Weight) and not torch.equal(other.dequantize(), gq.dequantize())


def test_gptq_act_order_is_dequantized_to_float() -> None:
    k, group = 256, 128
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(3))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)  # groups scattered over the inputs
    gq = quantize_groups(weight(32, k, 3), group, g_idx=g_idx, min_zero=1)
    p = pack_gptq(gq, v1=True)
    w = gptq_weight(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], 1)
    assert isinstance(w, torch.Tensor) and torch.equal(w, gq.dequantize())


@pytest.mark.parametrize("n,k", [(16, 128), (40, 256), (200, 512)])
def test_int4_blocks_rebuild_the_float_weights_bit_for_bit(kernel, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    """The blocks rebuild the dequantized matrix exactly; the kernel's product
    (sums factored per block) matches it to float32 rounding and gives a row
    the same bits alone or in a batch."""
    gq = quantize_groups(weight(n, k, n), 128)
    p = pack_awq(gq)
    w = awq_weight(p["qweight"], p["qzeros"], p["scales"])
    dense = gq.dequantize()
    blocks = pack_blocks(w)
    assert torch.equal(kernel.q4_unpack(blocks, n), dense)
    assert exact_blocks(w, kernel, dense) is not None
    assert exact_blocks(w, kernel, dense + 1e-3) is None
    panels = kernel.pack_weight(dense)
    bias = torch.randn(n)
    for m in (1, 3, 7, 200):
        x = torch.randn(m, k)
        y = kernel.q4_linear(x, blocks, n, bias)
        torch.testing.assert_close(y, kernel.packed_linear(x, panels, n, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, dense, bias), rtol=1e-4, atol=1e-4)
        assert torch.equal(kernel.q4_linear(x[-1:], blocks, n, bias)[0], y[-1])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4_bit_blocks_match_ggufs_dequantizer(qtype: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 512)) * 0.1).astype(np.float32)
    if qtype == "Q4_1":
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    else:
        raw, _ = quantize(w, qtype)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    mine = decode(qtype, raw, 512)
    assert mine is not None
    assert torch.equal(mine.dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_gguf_types_without_a_4_bit_form_are_left_to_float(qtype: str) -> None:
    raw, _ = quantize(np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32), qtype)
    assert decode(qtype, raw, 256) is None


def test_llama_qk_order_undoes_llama_cpps_interleave() -> None:
    rows, heads = 48, 3
    # llama.cpp's convert: w.reshape(heads, 2, rows // heads // 2, K).swapaxes(1, 2)
    interleaved = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    assert torch.equal(interleaved[llama_qk_order(rows, heads)], torch.arange(rows))


@pytest.mark.parametrize("qc,field", [
    (dict(quant_method="exl2", bits=4), "quant_method"),
    (dict(quant_method="gptq", bits=8, group_size=128), "bits"),
    (dict(quant_method="awq", bits=4, version="gemv"), "version"),
    (dict(quant_method="awq", bits=4, zero_point=False), "zero_point"),
])
def test_unsupported_quantization_is_a_clear_error(qc: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        quant_method({"quantization_config": qc})
    assert quant_method({}) is None
    assert quant_method({"quantization_config": dict(quant_method="awq", bits=4, group_size=128)}) == "awq"
