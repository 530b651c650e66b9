"""The Triton kernel and the engine on a CUDA GPU, in one short run.

CI machines have no GPU, so this is run by hand where one is lent (see
benchmarks/README.md, "On a GPU").  It needs only torch, triton and
transformers; the weights are random (made here from a config of the served
model's shape), so no checkpoint has to travel to the GPU machine:

1. the Triton paged-attention kernel against the torch path on the GPU, and
   its time per decode step next to the torch path's (triton.testing.do_bench);
2. the engine (float32) against transformers' greedy generate on the same
   random weights and GPU: tokens that agree, first-step logprob difference;
3. the engine in bfloat16: offline throughput (many prompts), a single
   stream, and transformers' static batching beside it in the same run.

    python -m benchmarks.gpu_check --model-dir DIR [--json OUT]

DIR holds config.json and the tokenizer files (the weights in it are ignored).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline import bench_hf, load_hf, make_prompts

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention shape
DEVICE = "cuda"  # --device cpu: a smoke run of the engine parts, without the kernel


def environment() -> dict[str, Any]:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__}


def decode_step(batch: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                num_layers: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """A decode step of `batch` sequences of `context` keys each, in shuffled
    cache blocks of `kv_dtype`, queries of `dtype`.  -> (q, k_new, v_new, kv_cache, meta)."""
    from engine.layers.attention import AttentionMetadata

    dev = torch.device("cuda")
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    gen = torch.Generator(device=dev).manual_seed(batch * 7919 + context)
    kv_cache = torch.randn(num_blocks, num_layers, 2, BLOCK, KV_HEADS, HEAD_DIM, device=dev,
                           dtype=dtype, generator=gen).to(kv_dtype)
    tables = torch.randperm(num_blocks, device=dev, generator=gen)[:batch * per_seq]
    tables = tables.view(batch, per_seq).to(torch.int32)
    last = context - 1
    slots = tables[:, last // BLOCK].long() * BLOCK + last % BLOCK
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dtype, generator=gen)
    k_new = kv_cache[:, 0, 0].reshape(-1, KV_HEADS, HEAD_DIM)[slots].to(dtype)
    v_new = kv_cache[:, 0, 1].reshape(-1, KV_HEADS, HEAD_DIM)[slots].to(dtype)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, device=dev, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, device=dev, dtype=torch.int32),
        block_tables=tables, query_lens=[1] * batch, seq_lens_host=[context] * batch,
        num_decodes=batch)
    return q, k_new, v_new, kv_cache, meta


def kernel_report() -> list[dict[str, Any]]:
    """Triton vs the torch path on decode steps of SmolLM2's attention shape."""


    rows = []
    shapes = ((1, 512), (16, 1024), (64, 2048), (256, 1024))
    # float32 queries over a float16 cache: what --kv-cache-dtype float16 serves
    for dtype, kv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                            (torch.float32, torch.float16)):
        for batch, context in shapes:
            rows.append(time_kernel(batch, context, dtype, kv_dtype))
            print(f"kernel {rows[-1]}", flush=True)
    return rows


def time_kernel(batch: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype
                ) -> dict[str, Any]:
    from triton.testing import do_bench

    from engine.layers.attention import paged_attention
    from engine.layers.triton_attention import triton_paged_attention

    scale = HEAD_DIM ** -0.5
    q, k_new, v_new, kv_cache, meta = decode_step(batch, context, dtype, kv_dtype)
    ref = paged_attention(q, k_new, v_new, kv_cache, 0, meta, scale, use_kernel=False)
    out = triton_paged_attention(q, kv_cache, 0, meta, scale)
    t_triton = do_bench(lambda: triton_paged_attention(q, kv_cache, 0, meta, scale))
    t_torch = do_bench(lambda: paged_attention(q, k_new, v_new, kv_cache, 0, meta, scale,
                                               use_kernel=False))
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * kv_cache.element_size()
    return {"dtype": str(dtype).removeprefix("torch."),
            "kv_dtype": str(kv_dtype).removeprefix("torch."), "batch": batch, "context": context,
            "max_abs_err": (out.float() - ref.float()).abs().max().item(),
            "triton_us": t_triton * 1e3, "torch_us": t_torch * 1e3,
            "triton_kv_gb_s": kv_bytes / (t_triton * 1e-3) / 1e9}


def random_model(model_dir: Path, out: Path) -> Path:
    """A model of `model_dir`'s config with random weights, saved with transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy(f, out / f.name)
    return out


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens per prompt (one at a time: no padding) and the first step's top logprob."""
    outs, first = [], []
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        with torch.inference_mode():
            g = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, output_scores=True, return_dict_in_generate=True)
        outs.append(g.sequences[0, len(p):].tolist())
        first.append(torch.log_softmax(g.scores[0][0].float(), -1).max().item())
    return outs, first


def parity_report(model: Path, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="float32", device=DEVICE)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    ours = llm.generate(prompts, params)
    del llm
    empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf = hf.to(torch.device(DEVICE)).eval()  # type: ignore[arg-type]  # transformers mistypes .to
    theirs, first = hf_greedy(hf, prompts, new_tokens)
    del hf
    empty_cache()
    same, agree, lp_diff = 0, 0, 0.0
    for o, t, lp in zip(ours, theirs, first, strict=True):
        toks, logprobs = o.outputs[0].token_ids, o.outputs[0].logprobs
        assert logprobs is not None
        same += toks == t
        agree += next((i for i, (a, b) in enumerate(zip(toks, t, strict=True)) if a != b), len(t))
        lp_diff = max(lp_diff, abs(logprobs[0][toks[0]].logprob - lp))
    report = {"prompts": len(prompts), "new_tokens": new_tokens, "identical": same,
              "tokens_before_first_difference": agree, "tokens": len(prompts) * new_tokens,
              "first_step_logprob_max_diff": lp_diff}
    print(f"parity {report}", flush=True)
    return report


def speed_report(model: Path, vocab: int, hf_too: bool, profile: bool) -> dict[str, Any]:

    from engine import LLM, SamplingParams

    report: dict[str, Any] = {}
    llm = LLM(model=str(model), dtype="bfloat16", device=DEVICE, max_num_seqs=256)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([[100] * 64] * 8, warm)
    for n, label in ((256, "offline_256x128"), (64, "offline_64x128")):
        prompts = make_prompts(n, 64, 512, vocab, seed=n)
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        report[label] = {"seconds": dt, "output_tok_s": toks / dt}
        print(f"speed {label} {report[label]}", flush=True)
    single = []
    for i in range(3):
        prompt = make_prompts(1, 32, 32, vocab, seed=100 + i)
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
        single.append(256 / (time.perf_counter() - t))
    report["single_stream_256"] = {"tok_s_median": statistics.median(single),
                                   "ms_per_token": 1000 / statistics.median(single)}
    print(f"speed single {report['single_stream_256']}", flush=True)
    if profile:  # where a single stream's time goes, host side and device side
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            llm.generate(make_prompts(1, 32, 32, vocab, seed=99),
                         SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    del llm
    empty_cache()
    if hf_too:
        hf = bench_hf(load_hf(model, torch.bfloat16, DEVICE), make_prompts(64, 64, 512, vocab, seed=64),
                      output_len=128, batch_size=16, pad_id=0, device=DEVICE)
        report["hf_static_batch16_64x128"] = hf
        print(f"speed hf {hf}", flush=True)
    return report


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True,
                    help="config.json and tokenizer files of the model whose shape to use")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    ap.add_argument("--profile", action="store_true",
                    help="print a profile of a single stream's 32 tokens (top 20 ops by host time)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a smoke run of the engine parts only (no kernel timings)")
    args = ap.parse_args()
    DEVICE = args.device
    report: dict[str, Any] = {}
    if DEVICE == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: this check runs only on a GPU machine")
        report["environment"] = environment()
        print(f"environment {report['environment']}", flush=True)
        report["kernel"] = kernel_report()
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(args.model_dir, Path(tmp) / "model")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(8, 16, 200, vocab, seed=1)
        report["parity"] = parity_report(model, prompts, 32)
        report["speed"] = speed_report(model, vocab, not args.skip_hf, args.profile)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
