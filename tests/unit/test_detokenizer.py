"""Incremental detokenizer against the real SmolLM2 (byte-level BPE) tokenizer."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.sampling_params import SamplingParams

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm -- isn't it?",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "emoji": "Launch 🚀🚀 went well 👍🏽 flags 🇯🇵🇫🇷 family 👨‍👩‍👧 done ✅",
    "accented": "Ünïcödé naïve façade — crème brûlée, São Paulo, Ελληνικά, Кириллица",
    "code": 'def f(x: int) -> int:\n    """Square."""\n    return x ** 2  # tab\there\n\n{"k": [1, 2]}\n',
}
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None
) -> list[str]:
    """Push ids (one at a time, or in the given chunk sizes) then flush -> deltas."""
    deltas, i = [], 0
    for size in chunks if chunks is not None else [1] * len(ids):
        deltas.append(detok.push(ids[i:i + size]))
        i += size
    assert i == len(ids)
    deltas.append(detok.flush())
    return deltas


def make(tokenizer: Any, prompt: str = PROMPT, **params: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_streaming_equals_full_decode_token_by_token(tokenizer: Any, name: str) -> None:
    ids = tokenizer.encode(TEXTS[name])
    detok = make(tokenizer)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == TEXTS[name]
    assert detok.text == TEXTS[name] and detok.stop_reason is None
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_streaming_in_random_chunks_and_without_prompt(tokenizer: Any, name: str) -> None:
    ids = tokenizer.encode(TEXTS[name])
    rng = random.Random(name)
    chunks: list[int] = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
    deltas = stream(make(tokenizer, prompt=""), ids, chunks)
    assert "".join(deltas) == TEXTS[name]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_partial_utf8_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # the emoji's bytes span several tokens
    detok = make(tokenizer)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]


def test_flush_releases_incomplete_utf8_like_decode(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 🚀")[:-1]  # cut inside the emoji
    deltas = stream(make(tokenizer), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert deltas[-1].endswith(REPLACEMENT_CHAR)  # only flush lets it out


def test_text_is_released_as_soon_as_it_is_decoded(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXTS["english"])
    detok = make(tokenizer, stop=["@@@"])  # a stop that never shows up holds nothing
    released = ""
    for n, i in enumerate(ids, 1):
        released += detok.push([i])
        assert released == tokenizer.decode(ids[:n])


def test_decodes_a_window_not_the_whole_output(tokenizer: Any) -> None:
    class Counting:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids: Sequence[int], **kw: Any) -> str:
            self.longest = max(self.longest, len(ids))
            return tokenizer.decode(ids, **kw)

    counting = Counting()
    ids = tokenizer.encode(TEXTS["english"] * 4)
    detok = IncrementalDetokenizer(counting, tokenizer.encode(PROMPT), SamplingParams())
    assert "".join(stream(detok, ids)) == TEXTS["english"] * 4
    assert counting.longest <= 8 < len(ids)


# ---------------------------------------------------------------- special tokens


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer: Any, skip: bool) -> None:
    ids = tokenizer.encode("Hello there.") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids += tokenizer.encode("\nAfter")
    detok = make(tokenizer, skip_special_tokens=skip)
    text = "".join(stream(detok, ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is (not skip)


# ---------------------------------------------------------------- stop strings


def test_stop_string_across_tokens_truncates_before_it(tokenizer: Any) -> None:
    text = "The answer is 42. Done here. More text after the stop."
    ids = tokenizer.encode(text)
    assert not any("42." in tokenizer.decode([i]) for i in ids)  # really spans tokens
    detok = make(tokenizer, stop=["42."])
    deltas = stream(detok, ids)
    assert detok.stop_reason == "42."
    assert detok.text == "".join(deltas) == "The answer is "
    assert detok.push(tokenizer.encode(" and more")) == ""  # nothing after a stop


def test_stop_string_included_when_asked(tokenizer: Any) -> None:
    ids = tokenizer.encode("The answer is 42. Done here.")
    detok = make(tokenizer, stop=["42."], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids)) == detok.text == "The answer is 42."


def test_stop_inside_a_single_token_cuts_mid_token(tokenizer: Any) -> None:
    detok = make(tokenizer, stop=["swer"])
    assert "".join(stream(detok, tokenizer.encode("The answer is 42."))) == "The an"
    assert detok.stop_reason == "swer"


def test_earliest_of_several_stops_wins(tokenizer: Any) -> None:
    detok = make(tokenizer, stop=["here", "Done", "zzz"])
    assert "".join(stream(detok, tokenizer.encode("The answer is 42. Done here."))) == "The answer is 42. "
    assert detok.stop_reason == "Done"


def test_stop_prefix_is_held_then_released_at_flush(tokenizer: Any) -> None:
    ids = tokenizer.encode("Count: 1 2 3 STOP")
    detok = make(tokenizer, stop=["STOPWORD"])
    pushed = "".join(detok.push([i]) for i in ids)
    assert pushed == "Count: 1 2 3 "  # "STOP" could still become "STOPWORD"
    assert detok.text == "Count: 1 2 3 STOP"
    assert detok.flush() == "STOP"
    assert detok.stop_reason is None


def test_stop_prefix_released_once_it_diverges(tokenizer: Any) -> None:
    detok = make(tokenizer, stop=["STOPWORD"])
    released = "".join(detok.push([i]) for i in tokenizer.encode("a STOP"))
    assert released == "a "
    released += "".join(detok.push([i]) for i in tokenizer.encode(" sign"))
    assert released == "a STOP sign" and detok.stop_reason is None


def test_stop_on_multibyte_text(tokenizer: Any) -> None:
    detok = make(tokenizer, stop=["世界"])
    assert "".join(stream(detok, tokenizer.encode(TEXTS["chinese"]))) == "你好，"
