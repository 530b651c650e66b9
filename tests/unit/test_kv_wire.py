"""KV layout checks and the control-message wire format: no UCX, milliseconds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_handoff import KVHandoff
from kvtransfer import wire
from kvtransfer.channel import block_buffer
from kvtransfer.layout import KVLayout, LayoutMismatch, check_compatible
from protos import pb
from services.kv_layout import (
    InvalidLayout,
    handoff_from_proto,
    handoff_to_proto,
    layout_from_proto,
    layout_to_proto,
)

SMOL = KVLayout("SmolLM2-135M-Instruct", "bfloat16", "bfloat16", block_size=16, num_layers=30,
                num_kv_heads=3, head_dim=64)


def test_block_bytes_of_the_default_model_is_360_kib() -> None:
    assert SMOL.block_bytes == 30 * 2 * 16 * 3 * 64 * 2 == 360 * 1024


def test_from_cache_reads_shape_and_dtype() -> None:
    kv = torch.zeros(5, 30, 2, 16, 3, 64, dtype=torch.bfloat16)
    assert KVLayout.from_cache(kv, SMOL.model_id, "bfloat16") == SMOL
    assert kv[0].numel() * kv.element_size() == SMOL.block_bytes
    with pytest.raises(ValueError, match="kv_cache must be"):
        KVLayout.from_cache(torch.zeros(5, 30, 3, 16, 3, 64), "m", "float32")


def test_an_fp8_cache_is_its_own_layout_of_half_the_bytes() -> None:
    kv = torch.zeros(5, 30, 2, 16, 3, 64, dtype=torch.float8_e4m3fn)
    fp8 = KVLayout.from_cache(kv, SMOL.model_id, torch.bfloat16)
    assert (fp8.dtype, fp8.kv_cache_dtype) == ("bfloat16", "float8_e4m3fn")
    assert fp8.block_bytes == SMOL.block_bytes // 2 == kv[0].numel()
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(SMOL, fp8)
    assert info.value.differences == {"kv_cache_dtype": ("bfloat16", "float8_e4m3fn")}


def test_the_protobuf_layout_has_exactly_the_dataclass_fields() -> None:
    """One definition: kvtransfer's KVLayout; the message (which the torch-free
    frontend reads field by field) mirrors it, and a registration is its dict."""
    fp8 = dataclasses.replace(SMOL, kv_cache_dtype="float8_e5m2")
    assert {f.name for f in pb.KVLayout.DESCRIPTOR.fields} == {f.name for f in dataclasses.fields(KVLayout)}
    assert layout_from_proto(layout_to_proto(fp8)) == fp8
    with pytest.raises(InvalidLayout, match="layout: .*model_id"):
        layout_from_proto(pb.KVLayout())


def test_the_handoff_carries_the_decode_layout_through_the_prefill_rpc() -> None:
    """The Prefill RPC mirrors the decode engine's KVHandoff, layout included; the
    prefill worker compares it with its own and names the field that differs."""
    fp8 = dataclasses.replace(SMOL, kv_cache_dtype="float8_e5m2")
    handoff = KVHandoff("r", (7, 3, 9), 1, fp8)
    msg = handoff_to_proto(handoff, kv_token=b"t")
    assert (list(msg.dst_block_ids), msg.first_block, msg.kv_token) == ([7, 3, 9], 1, b"t")
    assert handoff_from_proto(msg) == handoff
    handoff_from_proto(msg).check_layout(fp8)
    with pytest.raises(LayoutMismatch, match="kv_cache_dtype: local 'bfloat16' vs remote 'float8_e5m2'"):
        handoff_from_proto(msg).check_layout(SMOL)


def test_layout_dict_round_trip_and_validation() -> None:
    assert KVLayout.from_dict(SMOL.to_dict()) == SMOL
    with pytest.raises(ValueError, match="missing fields \\['head_dim'\\]"):
        KVLayout.from_dict({k: v for k, v in SMOL.to_dict().items() if k != "head_dim"})
    with pytest.raises(ValueError, match="unknown fields \\['extra'\\]"):
        KVLayout.from_dict({**SMOL.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="not a torch dtype"):
        KVLayout("m", "float13", "float13", 16, 1, 1, 1)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        KVLayout("m", "float32", "float32", 0, 1, 1, 1)


def test_compatible_layouts_pass() -> None:
    check_compatible(SMOL, KVLayout.from_dict(SMOL.to_dict()))


def test_mismatch_names_every_differing_field_with_both_values() -> None:
    other = KVLayout("other-model", "float32", "bfloat16", block_size=32, num_layers=30, num_kv_heads=3,
                     head_dim=64)
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(SMOL, other)
    msg = str(info.value)
    assert "model_id: local 'SmolLM2-135M-Instruct' vs remote 'other-model'" in msg
    assert "dtype: local 'bfloat16' vs remote 'float32'" in msg
    assert "block_size: local 16 vs remote 32" in msg
    assert "num_layers" not in msg and "head_dim" not in msg
    assert info.value.differences == {"model_id": ("SmolLM2-135M-Instruct", "other-model"),
                                      "dtype": ("bfloat16", "float32"), "block_size": (16, 32)}
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("msg", [
    wire.Hello(SMOL),
    wire.HelloAck(SMOL),
    wire.HelloAck(SMOL, error="KV layout mismatch (dtype: ...)"),
    wire.TransferHeader(seq=7, transfer_id="req-1/ü", block_ids=(5, 0, 2**32 - 1, 17)),
    wire.TransferHeader(seq=1, transfer_id="empty", block_ids=()),
    wire.TransferHeader(seq=9, transfer_id="r", block_ids=(3, 4), token=bytes(range(32))),
    wire.TransferHeader(seq=9, transfer_id="r", block_ids=(3,), token=b"\xff" * 255),
    wire.TransferHeader(seq=2**63, transfer_id="x" * 1000, block_ids=tuple(range(4096))),
    wire.Ready(seq=3),
    wire.Reject(seq=3, reason="transfer 'x' is not expected here"),
    wire.Reject(seq=4, reason=""),
    wire.Done(seq=3, nbytes=64 * 368640),
])
def test_control_messages_round_trip(msg: wire.Message) -> None:
    data = wire.encode(msg)
    assert data[:4] == wire.MAGIC
    assert wire.decode(data) == msg
    assert wire.decode(bytearray(data)) == msg


def test_header_is_compact() -> None:
    msg = wire.TransferHeader(seq=1, transfer_id="r", block_ids=tuple(range(1000)))
    assert len(wire.encode(msg)) == 6 + 15 + 1 + 4 * 1000
    with_token = wire.TransferHeader(seq=1, transfer_id="r", block_ids=tuple(range(1000)), token=b"t" * 16)
    assert len(wire.encode(with_token)) == 6 + 15 + 1 + 16 + 4 * 1000


@pytest.mark.parametrize("data, match", [
    (b"SSK", "shorter than its head"),
    (b"XXXX\x01\x04" + bytes(8), "bad magic"),
    (b"SSKV\x01\x04" + bytes(8), "protocol version 1"),  # a sender without transfer tokens
    (b"SSKV\x02\x63", "unknown control message kind 99"),
    (b"SSKV\x02\x04" + bytes(7), "malformed READY"),
    (b"SSKV\x02\x06" + bytes(17), "malformed DONE"),
    (b"SSKV\x02\x01{not json", "malformed HELLO"),
    (b"SSKV\x02\x01" + b'{"layout": {"model_id": "m"}}', "missing fields"),
])
def test_bad_messages_raise_wire_error(data: bytes, match: str) -> None:
    with pytest.raises(wire.WireError, match=match):
        wire.decode(data)


def test_truncated_header_raises() -> None:
    data = wire.encode(wire.TransferHeader(seq=1, transfer_id="abc", block_ids=(1, 2, 3)))
    for cut in (len(data) - 1, len(data) - 4, 10):
        with pytest.raises(wire.WireError, match="malformed HEADER"):
            wire.decode(data[:cut])
    with pytest.raises(wire.WireError, match="malformed HEADER"):
        wire.decode(data + b"\x00")


def test_header_rejects_ids_that_do_not_fit() -> None:
    with pytest.raises(wire.WireError, match="32 bits"):
        wire.encode(wire.TransferHeader(seq=1, transfer_id="a", block_ids=(2**32,)))
    with pytest.raises(wire.WireError, match="transfer id"):
        wire.encode(wire.TransferHeader(seq=1, transfer_id="a" * 70000, block_ids=()))
    with pytest.raises(wire.WireError, match="transfer token"):
        wire.encode(wire.TransferHeader(seq=1, transfer_id="a", block_ids=(), token=b"t" * 256))


def test_data_tags_are_distinct_per_block_and_transfer() -> None:
    tags = {wire.data_tag(seq, i) for seq in (1, 2, 3) for i in range(5000)}
    assert len(tags) == 3 * 5000
    assert wire.CONTROL_TAG not in tags
    assert all(hash(t) == t for t in tags)  # ucxx mixes hash(tag) into the wire tag


def test_block_buffer_is_a_zero_copy_byte_view() -> None:
    kv = torch.zeros(4, 2, 2, 4, 1, 8, dtype=torch.bfloat16)
    buf = block_buffer(kv, 2)
    assert buf.dtype.itemsize == 1 and buf.nbytes == kv[2].numel() * 2
    buf[:] = 0x3F  # written through the view, as UCX writes a received block
    assert torch.all(kv[2].view(torch.uint8) == 0x3F)
    assert not kv[1].view(torch.uint8).any() and not kv[3].view(torch.uint8).any()
