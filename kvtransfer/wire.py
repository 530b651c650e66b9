"""Control messages of the KV transfer protocol and the tags blocks travel on.

The exchange itself is described at the top of transport.py.  Every control
message is one byte string (sent with a length prefix, so any size fits):

    head   "<4sBB"   magic b"SSKV", protocol version, kind
    body   by kind, little-endian:
      HELLO      UTF-8 JSON {"layout": {...}}                  sender -> receiver, once per connection
      HELLO_ACK  UTF-8 JSON {"layout": {...}, "error": "..."}  receiver's layout; error "" = accepted
      HEADER     "<QIHB" seq, num_blocks, len(transfer_id), len(token);
                 transfer_id (UTF-8); token; num_blocks x "<I" destination block ids
      READY      "<Q" seq                                      receives are posted: send the blocks
      REJECT     "<Q" seq; reason (UTF-8)                      nothing will be written; the link stays up
      DONE       "<QQ" seq, nbytes                             every block landed

The handshake is JSON because it happens once per connection and is read by
people when it fails; the per-transfer messages are packed because a long
prompt carries thousands of block ids.
"""

from __future__ import annotations

import json
import secrets
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from kvtransfer.layout import KVLayout

MAGIC = b"SSKV"
VERSION = 2  # 2: HEADER carries the transfer's one-time token
_HEAD = struct.Struct("<4sBB")
_SEQ = struct.Struct("<Q")
_HEADER = struct.Struct("<QIHB")
_DONE = struct.Struct("<QQ")
MAX_TRANSFER_ID_BYTES = 0xFFFF
MAX_TOKEN_BYTES = 0xFF
MIN_TOKEN_BYTES = 16  # what a receiver accepts when it issues one
MAX_BLOCK_ID = 0xFFFFFFFF

# Tags are per connection (ucxx hashes them with the endpoint's own tag), so they
# only need to be unique within one connection: 0 is the control stream, block i
# of the transfer numbered seq travels on data_tag(seq, i).
CONTROL_TAG = 0


def data_tag(seq: int, index: int) -> int:
    # < 2**61, so Python's hash(tag) (which ucxx mixes in) is the identity
    return ((seq % (1 << 28)) << 32) | (index + 1)


def new_transfer_token() -> bytes:
    """A transfer's one-time token, issued by the receiver with its reservation (128 bits)."""
    return secrets.token_bytes(MIN_TOKEN_BYTES)


class WireError(ValueError):
    """A control message that this version cannot read."""


class Kind(IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    HEADER = 3
    READY = 4
    REJECT = 5
    DONE = 6


@dataclass(frozen=True)
class Hello:
    layout: KVLayout


@dataclass(frozen=True)
class HelloAck:
    layout: KVLayout
    error: str = ""


@dataclass(frozen=True)
class TransferHeader:
    seq: int  # numbers the transfers of one connection; picks the data tags
    transfer_id: str
    block_ids: tuple[int, ...]  # destination blocks on the receiver, in send order
    token: bytes = b""  # the one-time token the receiver issued for this transfer


@dataclass(frozen=True)
class Ready:
    seq: int


@dataclass(frozen=True)
class Reject:
    seq: int
    reason: str


@dataclass(frozen=True)
class Done:
    seq: int
    nbytes: int


Message = Hello | HelloAck | TransferHeader | Ready | Reject | Done


def encode(msg: Message) -> bytes:
    if isinstance(msg, Hello):
        return _head(Kind.HELLO) + _json({"layout": msg.layout.to_dict()})
    if isinstance(msg, HelloAck):
        return _head(Kind.HELLO_ACK) + _json({"layout": msg.layout.to_dict(), "error": msg.error})
    if isinstance(msg, TransferHeader):
        tid = msg.transfer_id.encode()
        if len(tid) > MAX_TRANSFER_ID_BYTES:
            raise WireError(f"transfer id is {len(tid)} bytes, at most {MAX_TRANSFER_ID_BYTES}")
        if len(msg.token) > MAX_TOKEN_BYTES:
            raise WireError(f"transfer token is {len(msg.token)} bytes, at most {MAX_TOKEN_BYTES}")
        if any(not 0 <= b <= MAX_BLOCK_ID for b in msg.block_ids):
            raise WireError("block ids must fit in 32 bits")
        n = len(msg.block_ids)
        return (_head(Kind.HEADER) + _HEADER.pack(msg.seq, n, len(tid), len(msg.token)) + tid
                + bytes(msg.token) + struct.pack(f"<{n}I", *msg.block_ids))
    if isinstance(msg, Ready):
        return _head(Kind.READY) + _SEQ.pack(msg.seq)
    if isinstance(msg, Reject):
        return _head(Kind.REJECT) + _SEQ.pack(msg.seq) + msg.reason.encode()
    if isinstance(msg, Done):
        return _head(Kind.DONE) + _DONE.pack(msg.seq, msg.nbytes)
    raise TypeError(f"not a control message: {msg!r}")


def decode(data: bytes | bytearray | memoryview) -> Message:
    buf = bytes(data)
    if len(buf) < _HEAD.size:
        raise WireError(f"control message of {len(buf)} bytes is shorter than its head")
    magic, version, kind = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: the peer is not a splitserve KV transport")
    if version != VERSION:
        raise WireError(f"protocol version {version}, this worker speaks {VERSION}")
    if kind not in {k.value for k in Kind}:
        raise WireError(f"unknown control message kind {kind}")
    try:
        return _decode_body(Kind(kind), buf[_HEAD.size:])
    except WireError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        raise WireError(f"malformed {Kind(kind).name} message: {e}") from e


def _decode_body(kind: Kind, body: bytes) -> Message:
    if kind in (Kind.HELLO, Kind.HELLO_ACK):
        obj = json.loads(body.decode())
        layout = KVLayout.from_dict(obj["layout"])
        return Hello(layout) if kind == Kind.HELLO else HelloAck(layout, str(obj.get("error", "")))
    if kind == Kind.HEADER:
        seq, n, tid_len, token_len = _HEADER.unpack_from(body)
        token_at = _HEADER.size + tid_len
        ids_at = token_at + token_len
        _expect_len(body, ids_at + 4 * n)
        tid = body[_HEADER.size:token_at].decode()
        return TransferHeader(seq, tid, struct.unpack_from(f"<{n}I", body, ids_at), body[token_at:ids_at])
    if kind == Kind.READY:
        _expect_len(body, _SEQ.size)
        return Ready(_SEQ.unpack(body)[0])
    if kind == Kind.REJECT:
        return Reject(_SEQ.unpack_from(body)[0], body[_SEQ.size:].decode())
    _expect_len(body, _DONE.size)
    seq, nbytes = _DONE.unpack(body)
    return Done(seq, nbytes)


def _head(kind: Kind) -> bytes:
    return _HEAD.pack(MAGIC, VERSION, kind)


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _expect_len(body: bytes, n: int) -> None:
    if len(body) != n:
        raise ValueError(f"body is {len(body)} bytes, expected {n}")  # decode() names the kind
