"""Speculative decoding on the real model (issue 5's acceptance tests):
greedy tokens are those of the engine without speculation for every method,
at batch sizes 1 and 8, with prefix caching, chunked prefill and preemption in
play; seeded sampling is reproducible and unaffected for requests that opt
out; no KV block of the target or of the draft leaks; bad configuration fails
at start naming the field.  (The sampling rule's losslessness is tested
statistically in tests/unit/test_spec_rejection.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams

THREADS = 1
SHARED = "Copy this sentence twice. The quick brown fox jumps over the lazy dog. The quick brown fox"
PROMPTS = [
    "Repeat the list exactly: apples, pears, plums, apples, pears, plums, apples, pears,",
    SHARED + " jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
    "The three primary colors are",
    SHARED + " sat down.",  # shares blocks with prompt 1: prefix caching
    "In 1969, the first humans",
    "A haiku about autumn leaves:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Tight on purpose: chunked prefill (24-token steps) and preemption (few blocks).
TIGHT = dict(dtype="float32", block_size=8, num_blocks=16, max_num_batched_tokens=24, max_model_len=256,
             num_threads=THREADS, seed=1)


def export_draft(target: Path, out: Path, num_layers: int, vocab_size: int | None = None) -> Path:
    """A smaller model directory with the target's tokenizer: its first
    num_layers layers, final norm and (tied) head.  vocab_size: truncate the
    vocabulary (an incompatible draft)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    tensors = {}
    with safe_open(str(target / "model.safetensors"), framework="pt") as st:
        for name in st.keys():  # noqa: SIM118
            parts = name.split(".")
            if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= num_layers:
                continue
            tensors[name] = st.get_tensor(name)
    if vocab_size is not None:
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:vocab_size].clone()
        cfg["vocab_size"] = vocab_size
    cfg["num_hidden_layers"] = num_layers
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / f).exists():
            shutil.copy(target / f, out / f)
    return out


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return export_draft(model_dir, tmp_path_factory.mktemp("draft") / "smol-4l", num_layers=4)


@pytest.fixture(scope="module")
def base_llm() -> LLM:
    """Without speculation, and without chunking or preemption (they don't change tokens)."""
    return LLM(**{**TIGHT, "num_blocks": 128, "max_num_batched_tokens": 2048})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(base_llm) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in base_llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def ngram_llm() -> LLM:
    return LLM(**TIGHT, speculative_config={  # type: ignore[arg-type]
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})


@pytest.fixture(scope="module")
def layerskip_llm() -> LLM:
    # SmolLM2 was not trained for early exit: its first layers draft poorly.
    return LLM(**TIGHT, speculative_config={  # type: ignore[arg-type]
        "method": "layerskip", "num_speculative_tokens": 3, "num_layers": 12})


@pytest.fixture(scope="module")
def draft_llm(draft_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(**TIGHT, speculative_config={  # type: ignore[arg-type]
        "method": "draft", "num_speculative_tokens": 3, "model": str(draft_dir)})


def draft_cache(llm: LLM):  # type: ignore[no-untyped-def]
    return getattr(llm.engine.spec.proposer, "cache", None)  # type: ignore[union-attr]


def assert_no_block_held(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine.has_unfinished()
    cache = draft_cache(llm)
    if cache is not None:
        assert cache.num_free_blocks == cache.num_blocks and cache.request_ids() == []


@pytest.mark.parametrize("method", ["ngram", "layerskip", "draft"])
def test_greedy_tokens_equal_without_speculation(method, reference, request) -> None:  # type: ignore[no-untyped-def]
    spec_llm = request.getfixturevalue(f"{method}_llm")
    eng = spec_llm.engine
    got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, GREEDY)]  # batch 8
    assert got == reference
    assert eng.scheduler.num_preemptions > 0  # preemption was in play
    assert eng.kv.prefix_hits > 0  # and prefix caching
    stats = eng.spec.stats
    assert stats.num_drafts > 0 and sum(stats.accepted_per_position) == stats.num_accepted_tokens
    if method == "ngram":  # the prompts repeat themselves
        assert stats.acceptance_rate > 0.3
    assert spec_llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == reference[0]  # batch 1
    assert_no_block_held(spec_llm)


def test_penalties_and_logit_bias_apply_as_without_speculation(ngram_llm, base_llm) -> None:  # type: ignore[no-untyped-def]
    """Penalties see each draft as already generated at the positions after it."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.1,
                            frequency_penalty=0.4, presence_penalty=0.2, logit_bias={28: -3.0})
    prompts = [PROMPTS[0], PROMPTS[3]]
    drafts = ngram_llm.engine.spec.stats.num_drafts
    want = [o.outputs[0].token_ids for o in base_llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in ngram_llm.generate(prompts, params)] == want
    assert ngram_llm.engine.spec.stats.num_drafts > drafts


def test_draft_equal_to_target_accepts_everything(model_dir, tmp_path, reference) -> None:  # type: ignore[no-untyped-def]
    """The draft caches stay in step with the target: a draft that is the
    target itself proposes exactly the target's greedy tokens."""
    same = export_draft(model_dir, tmp_path / "same", num_layers=30)
    llm = LLM(**TIGHT, speculative_config={  # type: ignore[arg-type]
        "method": "draft", "num_speculative_tokens": 3, "model": str(same), "adaptive": False})
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    assert got == reference[:3]
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0.95, stats
    assert_no_block_held(llm)


def test_sampling_with_many_rejections_and_aborts_leaks_no_block(draft_llm) -> None:  # type: ignore[no-untyped-def]
    """Hot sampling rejects most drafts; aborts land mid-decode, right after a
    verification; the tight pool preempts.  Every block of the target and of
    the draft comes back."""
    spec_llm = draft_llm
    eng = spec_llm.engine
    preemptions = eng.scheduler.num_preemptions
    hot = SamplingParams(temperature=1.5, max_tokens=10, ignore_eos=True, seed=3)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"hot{i}", p, hot)
    for _ in range(6):
        eng.step()
    for i in range(0, 8, 3):
        eng.abort(f"hot{i}")
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.num_preemptions > preemptions
    assert eng.spec.stats.num_draft_tokens > 2 * eng.spec.stats.num_accepted_tokens  # mostly rejected
    assert_no_block_held(spec_llm)


def test_seeded_sampling_reproducible_and_opt_out_unaffected(draft_llm) -> None:  # type: ignore[no-untyped-def]
    """The draft model draws its drafts from the requests' own seeded RNGs."""
    spec_llm = draft_llm
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, ignore_eos=True, seed=7)
    opted_out = SamplingParams(temperature=0.8, top_k=20, max_tokens=10, ignore_eos=True, seed=9,
                               disable_speculation=True)
    first = spec_llm.generate(PROMPTS[:2], [seeded, opted_out])
    drafts_before = spec_llm.engine.spec.stats.num_drafts
    alone = spec_llm.generate(PROMPTS[1], opted_out)[0].outputs[0].token_ids
    assert spec_llm.engine.spec.stats.num_drafts == drafts_before  # it never speculated
    assert alone == first[1].outputs[0].token_ids
    again = spec_llm.generate(PROMPTS[:2], [seeded, opted_out])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert_no_block_held(spec_llm)


@pytest.mark.parametrize("cfg, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "layerskip", "num_speculative_tokens": 2, "num_layers": 30}, "num_layers"),
    ({"method": "draft", "num_speculative_tokens": 2, "model": "/nonexistent"}, "model"),
])
def test_bad_config_fails_at_start(cfg, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        LLM(**TIGHT, speculative_config=cfg)  # type: ignore[arg-type]


def test_draft_with_another_vocab_or_tokenizer_fails_at_start(model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    small_vocab = export_draft(model_dir, tmp_path / "vocab", num_layers=1, vocab_size=49000)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(**TIGHT, speculative_config={"method": "draft", "num_speculative_tokens": 2,  # type: ignore[arg-type]
                                         "model": str(small_vocab)})
    other_tok = export_draft(model_dir, tmp_path / "tok", num_layers=1)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(**TIGHT, speculative_config={"method": "draft", "num_speculative_tokens": 2,  # type: ignore[arg-type]
                                         "model": str(other_tok)})


def test_decode_worker_speculates_and_honours_the_opt_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A decode worker process, speculation configured by JSON plus a flag:
    a request's greedy tokens equal those of the same request opted out over
    gRPC, and the worker's load report counts the drafts of the first only."""
    import grpc

    from protos import pb, pb_grpc
    from services.convert import sampling_to_proto

    from .procs import start_worker

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    proc = start_worker("decode", "sd0", tmp_path, "--num-blocks", "64", "--speculative-config", spec,
                        "--prompt-lookup-min", "2")
    try:
        with grpc.insecure_channel(proc.wait_ready()) as ch:
            stub = pb_grpc.DecodeStub(ch)

            def counters() -> dict[str, float]:
                report = next(iter(stub.WatchLoad(pb.LoadRequest(interval_seconds=0.1))))
                return dict(report.counters)

            def tokens(rid: str, params: SamplingParams) -> list[int]:
                req = pb.WorkerGenerateRequest(request_id=rid, prompt_token_ids=ids,
                                               sampling=sampling_to_proto(params))
                return [t for c in stub.Generate(req, timeout=120) for t in c.token_ids]

            from engine.models.loader import load_tokenizer, resolve_model

            ids = load_tokenizer(resolve_model(None)).encode(PROMPTS[0])
            before = counters()
            opted_out = tokens("plain", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       disable_speculation=True))
            middle = counters()
            assert middle["spec_decode_num_drafts"] == before["spec_decode_num_drafts"]
            speculated = tokens("spec", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            after = counters()
            info = stub.Info(pb.InfoRequest(), timeout=10)
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        per_pos = {s.labels["position"]: s.value
                   for f in text_string_to_metric_families(httpx.get(info.metrics_url, timeout=10).text)
                   for s in f.samples if s.name == "splitserve_spec_decode_num_accepted_tokens_per_pos_total"}
        assert sorted(per_pos) == ["0", "1", "2", "3"]  # k = 4 positions
        assert sum(per_pos.values()) == after["spec_decode_num_accepted_tokens"]
        assert speculated == opted_out and len(speculated) == 12
        assert after["spec_decode_num_drafts"] > middle["spec_decode_num_drafts"]
        assert 0 < after["spec_decode_num_accepted_tokens"] <= after["spec_decode_num_draft_tokens"]
    finally:
        proc.stop()
