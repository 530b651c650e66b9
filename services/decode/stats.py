"""A decode worker's counters (its load report's extra counters and metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeStats:
    remote_prefills: int = 0
    local_prefills: int = 0
    kv_transfer_failures: int = 0
    # Of those, refused for this worker's KV layout (another weights version,
    # dtype or block size: a rolling update halfway, or a misconfiguration).
    kv_layout_refusals: int = 0
    kv_transfer_recomputes: int = 0
    kv_bytes_received: int = 0
    waits_for_blocks: int = 0  # reservations that found the pool short and waited for blocks to free
    unknown_prefill_refusals: int = 0  # Generate named a prefill worker this worker does not know
    kv_transfer_seconds: float = 0.0  # total, from asking the prefill worker to the blocks landing
    session_requests: int = 0  # requests started on a Session call (the rest came as Generate calls)
    session_messages: int = 0  # SessionResponse messages written
    session_outputs: int = 0  # request outputs they carried (per message: the requests a step advanced)
