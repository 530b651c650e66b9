"""The numbers `splitserve bench serve` reports, from per-request timings.
Pure functions, no I/O.

    TTFT  request sent -> first chunk with text
    ITL   gap between consecutive tokens; a chunk that carries k tokens has its
          gap from the previous chunk spread evenly over them
    TPOT  (e2e - TTFT) / (output tokens - 1): a request's mean time per token
    e2e   request sent -> stream closed
    goodput  requests/s that met every SLO given: TTFT <= --slo-ttft-ms and
          TPOT <= --slo-itl-ms (the per-request mean ITL, as DistServe and
          vLLM's --goodput define it; a single slow gap does not fail a request)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    group: str
    ok: bool
    start: float = 0.0  # seconds after the benchmark started
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the server's usage, when it sends one
    token_times: list[float] = field(default_factory=list)  # seconds after `start`, one per token
    error: str = ""

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def chunk_token_counts(text_lens: Sequence[int], total: int) -> list[int]:
    """How many of a response's `total` tokens each chunk with text carried:
    one each, and any surplus (several tokens per chunk: speculative decoding,
    text held back by the server) in proportion to the chunk's text length,
    largest remainders first.  `total` below the chunk count (a server whose
    usage undercounts) gives one each."""
    n = len(text_lens)
    if n == 0:
        return []
    counts = [1] * n
    extra = total - n
    if extra <= 0:
        return counts
    weights = [max(1, w) for w in text_lens]
    scale = extra / sum(weights)
    shares = [w * scale for w in weights]
    for i, s in enumerate(shares):
        counts[i] += int(s)
    left = extra - sum(int(s) for s in shares)
    by_remainder = sorted(range(n), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


def spread_token_times(chunk_times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Each token's arrival time: the first chunk's tokens all arrive with it
    (their gaps are not inter-token latencies, so they are merged into one),
    a later chunk's k tokens evenly over the gap since the previous chunk."""
    if not chunk_times:
        return []
    out = [chunk_times[0]]
    for prev, now, k in zip(chunk_times, chunk_times[1:], counts[1:], strict=False):
        gap = now - prev
        out.extend(prev + gap * (j + 1) / k for j in range(k))
    return out


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds; None for no values (valid JSON, unlike NaN)."""
    ms = [1000 * s for s in seconds]
    out: dict[str, float | None] = {"mean": sum(ms) / len(ms) if ms else None}
    out.update({f"p{p}": percentile(ms, p) if ms else None for p in PERCENTILES})
    return out


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and 1000 * r.ttft > slo_ttft_ms:
        return False
    tpot = r.tpot
    return slo_itl_ms is None or tpot is None or 1000 * tpot <= slo_itl_ms


def summarize(results: Sequence[RequestResult], duration: float, slo_ttft_ms: float | None = None,
              slo_itl_ms: float | None = None) -> dict[str, Any]:
    """Totals, throughput and latency distributions (milliseconds) of the
    successful requests; goodput when an SLO is given."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok]
    duration = max(duration, 1e-9)
    s: dict[str, Any] = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "output_tokens": out_tokens,
        "input_tokens": None if None in prompt_counts else sum(p or 0 for p in prompt_counts),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itls]),
        "e2e_ms": distribution_ms([r.e2e for r in ok]),
    }
    if slo_ttft_ms is not None or slo_itl_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_itl_ms) for r in results)
        s["goodput"] = {"slo_ttft_ms": slo_ttft_ms, "slo_itl_ms": slo_itl_ms, "good_requests": good,
                        "request_goodput": good / duration,
                        "good_fraction": good / len(results) if results else None}
    return s


def summarize_groups(results: Sequence[RequestResult], duration: float, slo_ttft_ms: float | None = None,
                     slo_itl_ms: float | None = None) -> dict[str, Any]:
    """`summarize` over all requests, with a "groups" entry per group when the
    workload has more than one (long-prompt interference: short, long)."""
    s = summarize(results, duration, slo_ttft_ms, slo_itl_ms)
    names = sorted({r.group for r in results})
    if len(names) > 1:
        s["groups"] = {g: summarize([r for r in results if r.group == g], duration, slo_ttft_ms, slo_itl_ms)
                       for g in names}
    return s


def _row(name: str, d: dict[str, float | None]) -> str:
    cells = (d[k] for k in ("mean", *(f"p{p}" for p in PERCENTILES)))
    return f"  {name:<6}" + "".join("         -" if v is None else f"{v:>10.1f}" for v in cells)


def format_table(s: dict[str, Any], title: str = "") -> str:
    lines = [title] if title else []
    lines += [f"  requests {s['completed']}/{s['requests']} ok ({s['failed']} failed) in "
              f"{s['duration_s']:.1f} s: {s['request_throughput']:.2f} req/s, "
              f"{s['output_throughput']:.1f} output tok/s ({s['output_tokens']} tokens)"]
    if "goodput" in s:
        g = s["goodput"]
        lines.append(f"  goodput  {g['request_goodput']:.2f} req/s ({g['good_requests']} of "
                     f"{s['requests']} met TTFT <= {g['slo_ttft_ms']} ms, ITL <= {g['slo_itl_ms']} ms)")
    lines.append(f"  {'ms':<6}" + "".join(f"{k:>10}" for k in ("mean", *(f"p{p}" for p in PERCENTILES))))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "e2e")):
        lines.append(_row(name, s[key]))
    for g, sub in s.get("groups", {}).items():
        lines.append(format_table(sub, f"[{g}]"))
    return "\n".join(lines)
