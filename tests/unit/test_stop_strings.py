"""The stop-string matcher: the same answers as searching the whole text, in linear time."""

from __future__ import annotations

import random
import time

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopMatcher


def reference(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Earliest match ending past text[:start], ties to the longer stop (the old search)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(stop) > len(best[1]))):
            best = (i, stop)
    return best


def reference_held(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)


def test_matches_a_full_search_on_random_text() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 3))]
        matcher, text = StopMatcher(stops), ""
        while len(text) < 30:
            chunk = "".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
            start, text = len(text), text + chunk
            hit = matcher.feed(chunk)
            assert hit == reference(text, stops, start), (stops, text)
            if hit is not None:
                break
            assert matcher.held() == reference_held(text, stops), (stops, text)


class _Letters:
    """One letter per token id: a tokenizer with no model."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def test_long_stop_strings_cost_linear_time() -> None:
    """16 stop strings of 20k characters over a 4,000-token output: the old
    matcher spent about 10 ms a token by the end (quadratic), this one microseconds."""
    stops = ["ab" * 10_000 + "!"] * 16
    detok = IncrementalDetokenizer(_Letters(), [0], SamplingParams(stop=stops))
    t = time.perf_counter()
    released = "".join(detok.push([i]) for i in range(4000))
    assert time.perf_counter() - t < 2.0  # about 0.06 s here; the old matcher took about 20 s
    assert detok.stop_reason is None
    assert released + detok.flush() == _Letters().decode(list(range(4000)))
