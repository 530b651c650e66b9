"""Prompt lookup: propose the tokens that followed the latest earlier
occurrence of the request's last n tokens (n from max down to min), searched
over its own prompt and output.  No weights, no torch: it pays off when the
output repeats its input (rewriting, editing, quoting code).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.request import Request


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the
    longest suffix of `tokens` (n_max >= length >= n_min) seen before."""
    num = len(tokens)
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        suffix = list(tokens[num - n:])
        last = suffix[-1]
        # Right to left (the latest occurrence wins); a match may overlap the
        # suffix (periodic text) but must end before the last token.
        i = num - 2
        while i >= n - 1:
            if tokens[i] == last and list(tokens[i - n + 1:i + 1]) == suffix:
                return list(tokens[i + 1:i + 1 + k])
            i -= 1
    return []


class NgramProposer:
    """Deterministic proposals: the draft distribution is one-hot."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> dict[str, tuple[list[int], Any]]:
        out: dict[str, tuple[list[int], Any]] = {}
        for req, k in zip(reqs, ks, strict=True):
            drafts = ngram_lookup(req.all_token_ids, k, self.n_min, self.n_max)
            if drafts:
                out[req.request_id] = (drafts, None)
        return out

    def free(self, request_id: str) -> None:
        pass
