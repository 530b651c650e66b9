"""KV block transfer between prefill and decode workers over UCX.

Knows block ids, not the scheduler.  `KVTransport` (and ucxx with it) is
imported lazily, so the layout and wire format can be used without UCX.
"""

from typing import TYPE_CHECKING, Any

from kvtransfer.errors import (
    TransferCancelled,
    TransferError,
    TransferFailed,
    TransferRejected,
    TransferTimeout,
)
from kvtransfer.layout import KVLayout, LayoutMismatch, check_compatible
from kvtransfer.stats import DirectionStats, TransferRecord, TransportStats
from kvtransfer.ucx_env import shutdown_ucx

if TYPE_CHECKING:
    from kvtransfer.sender import SendFault
    from kvtransfer.transport import KVTransport

__all__ = [
    "KVLayout", "KVTransport", "LayoutMismatch", "SendFault", "check_compatible", "shutdown_ucx",
    "TransferError", "TransferTimeout", "TransferRejected", "TransferFailed", "TransferCancelled",
    "TransferRecord", "DirectionStats", "TransportStats",
]


def __getattr__(name: str) -> Any:
    if name == "KVTransport":
        from kvtransfer.transport import KVTransport
        return KVTransport
    if name == "SendFault":
        from kvtransfer.sender import SendFault
        return SendFault
    raise AttributeError(name)
