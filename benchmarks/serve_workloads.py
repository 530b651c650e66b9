"""Workloads for `splitserve bench serve`: what to send, how long to let it
answer, and when.  Pure and seeded: the same flags give the same requests on
every machine and against every server, so numbers from different systems
compare."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

# Common English words, each one token (with its leading space) in SmolLM2's
# vocabulary, so a prompt of N words is N tokens there (about as many in other
# Llama-family vocabularies).
_WORD_TEXT = """
the of and to in is was for on that with as by at from his it an were are which this be or
her had not but first one their its new after who they have has been also he she we you all
two can more other time some when there would into than city made may over about world
three these year years school only most later known where then such many state during
between both under while each season film team out war house used people water name high
river part life small family great long since music game area north south east west day
work book group second place began age village old number town way art four country power
line land light garden story early church end government table door island paper road
king queen army ship plant bird tree stone horse field market bridge station lake forest
mountain valley voice child woman man friend teacher doctor student farmer writer player
red blue green black white yellow brown golden silver dark bright quiet loud cold warm soft
hard fast slow young simple strong heavy clear open close short full empty rich poor
morning evening night summer winter spring autumn week month hour minute moment history
science language letter number picture window kitchen bread apple river sea sky rain snow
wind fire earth metal glass wood cloth coffee tea milk sugar salt honey fruit flower grass
walk run read write speak listen watch build carry bring hold keep leave find give take
make move play sing draw paint teach learn think know feel hear see call ask answer help
start stop turn open begin finish travel follow return arrive decide remember explain
"""
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int
    arrival_time: float | None = None  # seconds after the start; None: set by the request rate
    group: str = "main"  # e.g. "short" / "long": reported separately


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_workload(num: int, min_words: int, max_words: int, output_len: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Prompts of a uniformly random length in [min_words, max_words]."""
    if not 1 <= min_words <= max_words:
        raise ValueError("input lengths: need 1 <= --input-len-min <= --input-len-max")
    rng = random.Random(seed)
    return [BenchRequest(random_words(rng, rng.randint(min_words, max_words)), output_len)
            for _ in range(num)]


def shared_prefix_workload(num: int, prefix_words: int, suffix_words: int, output_len: int,
                           seed: int = 0) -> list[BenchRequest]:
    """One long prefix (a system prompt, a document) shared by every request,
    then each request's own suffix (the question)."""
    rng = random.Random(seed)
    prefix = random_words(rng, prefix_words)
    return [BenchRequest(f"{prefix}\n{random_words(rng, suffix_words)}", output_len) for _ in range(num)]


def poisson_arrivals(num: int, rate: float, seed: int = 0, start: float = 0.0) -> list[float]:
    """Arrival times of a Poisson process with `rate` requests per second;
    rate = inf: everything at `start`."""
    if rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if rate == float("inf"):
        return [start] * num
    rng = random.Random(seed)
    t, out = start, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def interference_workload(num_short: int, min_words: int, max_words: int, output_len: int,
                          rate: float, long_words: int, long_interval: float, long_output_len: int,
                          seed: int = 0) -> list[BenchRequest]:
    """A Poisson stream of short chats at `rate`, and a long prompt every
    `long_interval` seconds (the first half an interval in) while the stream
    lasts.  The short chats' inter-token latency shows how much the long
    prefills stall running decodes: colocated they share the engine's steps,
    disaggregated they should not."""
    if rate == float("inf"):
        raise ValueError("long-prompt-interference needs a finite --request-rate for the short chats")
    if long_interval <= 0:
        raise ValueError("--long-interval must be > 0")
    rng = random.Random(seed)
    times = poisson_arrivals(num_short, rate, seed + 1)
    shorts = [BenchRequest(random_words(rng, rng.randint(min_words, max_words)), output_len, t, "short")
              for t in times]
    span = times[-1] if times else 0.0
    longs: list[BenchRequest] = []
    t = long_interval / 2
    while t < span or not longs:
        longs.append(BenchRequest(random_words(rng, long_words), long_output_len, t, "long"))
        t += long_interval
    return sorted(shorts + longs, key=lambda r: r.arrival_time or 0.0)


def load_replay(path: str | Path) -> list[BenchRequest]:
    """A JSONL file, one request a line: {"prompt": str, "output_len": int,
    "arrival_time": seconds (optional; without it the request rate decides)}."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, output_len = row["prompt"], row["output_len"]
                arrival = row.get("arrival_time")
                if not isinstance(prompt, str) or not isinstance(output_len, int) or output_len < 1:
                    raise ValueError("prompt must be a string and output_len an integer >= 1")
                if arrival is not None and (not isinstance(arrival, (int, float)) or arrival < 0):
                    raise ValueError("arrival_time must be a number >= 0")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e!r}") from None
            out.append(BenchRequest(prompt, output_len, None if arrival is None else float(arrival)))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def with_arrivals(requests: list[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """Give the requests without an arrival time one from a Poisson process
    at `rate`, in order."""
    missing = [i for i, r in enumerate(requests) if r.arrival_time is None]
    times = poisson_arrivals(len(missing), rate, seed)
    out = list(requests)
    for i, t in zip(missing, times, strict=True):
        out[i] = replace(out[i], arrival_time=t)
    return out
