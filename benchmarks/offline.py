"""Offline throughput: splitserve's engine vs Hugging Face `generate` with
static batching, on the same prompts and weights, in one run.

    splitserve bench offline            # 64 prompts of 64-512 tokens x 128 new tokens, bf16
    splitserve bench offline --hf-dtypes float32,bfloat16   # HF in each; the ratio is to its fastest
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: SmolLM2 keeps its special tokens there.
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def bench_splitserve(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[0][:16], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt}


def bench_hf(model_dir: Any, dtype: Any, prompts: list[list[int]], output_len: int,
             batch_size: int, pad_id: int, device: str = "cpu") -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]  # transformers mistypes .to
    n = 0
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
        n += (out.shape[1] - width) * len(batch)
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt}


def build_parser() -> argparse.ArgumentParser:
    from services.cli import add_engine_args
    from services.help_format import with_defaults

    p = argparse.ArgumentParser(prog="splitserve bench offline",
                                description="offline throughput vs Hugging Face static batching")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64, help="prompts in the batch")
    p.add_argument("--min-prompt-len", type=int, default=64, help="shortest prompt, tokens")
    p.add_argument("--max-prompt-len", type=int, default=512, help="longest prompt, tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--hf-batch-size", type=int, default=16, help="Hugging Face generate's static batch")
    p.add_argument("--hf-dtypes", default="",
                   help="comma-separated dtypes to run Hugging Face generate in, each in turn "
                        "(e.g. float32,bfloat16: its best on a CPU with native bf16); default: the engine's")
    p.add_argument("--skip-hf", action="store_true", help="measure splitserve only")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    with_defaults(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine import LLM
    from services.cli import engine_kwargs

    args = build_parser().parse_args(argv)

    kw = engine_kwargs(args)
    if kw["num_threads"] is None:
        kw["num_threads"] = torch.get_num_threads()
    torch.set_num_threads(kw["num_threads"])
    llm = LLM(**kw)
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                           llm.engine.vocab_size)
    rows: dict[str, dict[str, float]] = {}
    dtype = llm.engine.runner.dtype
    rows["splitserve"] = bench_splitserve(llm, prompts, args.output_len)
    print(f"splitserve: {rows['splitserve']}", flush=True)
    if not args.skip_hf:
        model_dir = llm.engine.runner.model_dir
        del llm
        hf_dtypes = [getattr(torch, d) for d in args.hf_dtypes.split(",") if d] or [dtype]
        for hf_dtype in hf_dtypes:
            name = str(hf_dtype).removeprefix("torch.")
            rows[f"hf-generate (static batch {args.hf_batch_size}, {name})"] = bench_hf(
                model_dir, hf_dtype, prompts, args.output_len, args.hf_batch_size, pad_id=0)
    hf = [r["output_tok_s"] for name, r in rows.items() if name != "splitserve"]
    base = max(hf) if hf else rows["splitserve"]["output_tok_s"]  # Hugging Face at its fastest
    print(f"{args.num_prompts} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens x "
          f"{args.output_len} new tokens, {str(dtype).removeprefix('torch.')}, "
          f"{kw['num_threads']} threads")
    print(f"{'system':<44} {'seconds':>9} {'out tok/s':>10} {'vs HF':>7}")
    for name, r in rows.items():
        print(f"{name:<44} {r['seconds']:>9.1f} {r['output_tok_s']:>10.1f} "
              f"{r['output_tok_s'] / base:>6.2f}x")
    if args.json:
        print(json.dumps({"bench": "offline", **{k: v for k, v in rows.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
