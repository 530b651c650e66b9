"""Speculative configuration errors name the field; adaptive k and metrics."""

from __future__ import annotations

import pytest

from engine.config import SpeculativeConfig
from engine.spec_decode.adaptive import AdaptiveK, SpecDecodeStats


@pytest.mark.parametrize("cfg, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"method": "draft", "num_speculative_tokens": 2}, "model"),
    ({"method": "layerskip", "num_speculative_tokens": 2}, "num_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
])
def test_bad_config_names_the_field(cfg, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(cfg)


def test_vllm_shaped_dict() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens) == ("ngram", 4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    assert not SpeculativeConfig.from_dict(None).enabled


def test_adaptive_k_shrinks_pauses_and_probes_with_backoff() -> None:
    a = AdaptiveK(k_max=4, enabled=True, min_rate=0.3, probe_interval=4)
    first = a.num_to_propose("r")
    assert 1 <= first <= 4
    for _ in range(3):
        a.observe("r", 4, 4)
    assert a.num_to_propose("r") == 4  # all accepted: full length
    ks = []
    for _ in range(40):
        k = a.num_to_propose("r")
        ks.append(k)
        a.observe("r", k, 0)  # nothing accepted
    assert ks[0] == 4 and 0 < ks[1] < 4 and ks[3] == 0  # proposes fewer, then none...
    probes = [i for i, k in enumerate(ks) if i > 3 and k]
    assert all(ks[i] == 1 for i in probes) and len(probes) >= 2  # ...but probes with one token,
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # less and less often while probes fail
    a.observe("r", 1, 1)  # a probe succeeds: speculating again
    assert a.num_to_propose("r") >= 1
    a.forget("r")
    assert a.num_to_propose("r") == first
    off = AdaptiveK(k_max=3, enabled=False, min_rate=0.3, probe_interval=5)
    off.observe("r", 3, 0)
    assert off.num_to_propose("r") == 3


def test_stats_count_drafts_and_accepted_positions() -> None:
    s = SpecDecodeStats("ngram", accepted_per_position=[0, 0, 0])
    s.record(3, 2)
    s.record(2, 0)
    s.record(0, 0)  # no drafts: not a speculation
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.accepted_per_position == [1, 1, 0]
    assert s.acceptance_rate == pytest.approx(0.4) and s.mean_accepted_length == pytest.approx(2.0)
