"""Why a KV transfer did not complete.

Every error here means the same thing to the engine: the blocks did not all
arrive, so decode recomputes the prompt (or fails, by policy). When `send()`
raises or an `expect()` future fails, no byte of that transfer will be read
from or written to KV memory any more, so the caller may free the blocks.
A layout mismatch is not among them: it is a deployment error (`LayoutMismatch`).
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer did not complete."""


class TransferTimeout(TransferError, TimeoutError):
    """The transfer did not finish within its time limit."""


class TransferRejected(TransferError):
    """The receiver refused the transfer: unknown, cancelled, already running, or other block ids."""


class TransferFailed(TransferError):
    """The connection broke or the peer broke the protocol."""


class TransferCancelled(TransferError):
    """The receiver cancelled the transfer (`KVTransport.cancel`)."""
