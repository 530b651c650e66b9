"""Prompt lookup and the draft cache's bookkeeping.  No torch, no model."""

from __future__ import annotations

from engine.spec_decode.draft_cache import DraftKVCache, common_prefix_len
from engine.spec_decode.ngram import ngram_lookup


def test_longest_suffix_wins_then_latest_occurrence() -> None:
    toks = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0..2 (followed by 9, 7); [2, 3] later at 5..6 (followed by 8)
    assert ngram_lookup(toks, 2, 2, 3) == [9, 7]
    assert ngram_lookup(toks, 2, 2, 2) == [8, 5]  # only bigrams: the latest one
    assert ngram_lookup(toks, 5, 1, 1) == [8, 5, 1, 2, 3]


def test_no_match_below_min_and_never_the_suffix_itself() -> None:
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_lookup([5, 1, 7, 1], 2, 2, 3) == []  # only a unigram repeats
    assert ngram_lookup([5, 1, 7, 1], 2, 1, 3) == [7, 1]
    assert ngram_lookup([4], 2, 1, 3) == []


def test_periodic_text_proposes_its_continuation() -> None:
    assert ngram_lookup([6, 6, 6, 6], 3, 2, 3) == [6]  # overlapping match, one token left after it
    assert ngram_lookup([1, 2, 1, 2, 1, 2], 4, 2, 4) == [1, 2]


def test_draft_cache_rolls_back_and_frees_emptied_blocks() -> None:
    cache = DraftKVCache(num_blocks=6, block_size=4)
    assert cache.reserve("a", 10) is not None and cache.num_free_blocks == 3
    cache.set_tokens("a", list(range(10)))
    cache.rollback("a", common_prefix_len(cache.tokens("a"), [0, 1, 2, 3, 4, 99]))
    assert cache.tokens("a") == [0, 1, 2, 3, 4] and cache.num_free_blocks == 4
    assert cache.reserve("b", 17) is None and cache.num_free_blocks == 4  # short: nothing taken
    cache.free("a")
    cache.free("b")
    assert cache.num_free_blocks == 6 and cache.request_ids() == []
