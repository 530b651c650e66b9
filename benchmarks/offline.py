"""Offline throughput: splitserve's engine vs Hugging Face `generate` with
static batching, on the same prompts and weights, in one run.

    splitserve bench offline            # 64 prompts of 64-512 tokens x 128 new tokens, bf16
    splitserve bench offline --hf-dtypes float32,bfloat16   # HF in each; the ratio is to its fastest
    splitserve bench offline --rounds 2   # each system twice, the order reversed in the second round

With more than one round, a system's figure is its rounds' tokens over their
seconds, and each round runs the systems in the order the last one ended
(ABBA...): a host whose speed drifts through the run weighs on every system
alike, where one round would charge the drift to whichever ran last.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from functools import partial
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


def load_hf(model_dir: Any, dtype: Any, device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(torch.device(device)).eval()  # type: ignore[arg-type]  # transformers mistypes .to


def bench_hf(model: Any, prompts: list[list[int]], *, output_len: int, batch_size: int, pad_id: int,
             device: str = "cpu") -> dict[str, float]:
    import torch

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


def run_rounds(systems: dict[str, Callable[[list[list[int]]], dict[str, Any]]],
               prompts: Callable[[int], list[list[int]]], rounds: int) -> dict[str, dict[str, Any]]:
    """Each system `rounds` times, every other round in reverse order, round i
    on prompts(i) (new prompts each round: none is in a prefix cache) -> name ->
    its rounds' seconds and tokens summed, tok/s over the sum, and each round's tok/s."""
    rows: dict[str, dict[str, Any]] = {name: {"seconds": 0.0, "output_tokens": 0, "rounds": []}
                                       for name in systems}
    names = list(systems)
    for i in range(rounds):
        batch = prompts(i)
        for name in names if i % 2 == 0 else names[::-1]:
            got = systems[name](batch)
            print(f"{name}, round {i + 1}: {got}", flush=True)
            row = rows[name]
            row["seconds"] += got["seconds"]
            row["output_tokens"] += got["output_tokens"]
            row["rounds"].append(got["output_tok_s"])
    for row in rows.values():
        row["output_tok_s"] = row["output_tokens"] / row["seconds"]
    return rows


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
    p.add_argument("--rounds", type=int, default=1,
                   help="times each system runs, the order reversed each round (ABBA); a system's "
                        "figure is its rounds' tokens over their seconds")
    p.add_argument("--skip-hf", action="store_true", help="measure splitserve only")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    with_defaults(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine import LLM
    from services.cli import engine_kwargs

    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds: must be >= 1, got {args.rounds}")

    kw = engine_kwargs(args)
    if kw["num_threads"] is None:
        kw["num_threads"] = torch.get_num_threads()
    torch.set_num_threads(kw["num_threads"])
    llm = LLM(**kw)
    prompts = partial(make_prompts, args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                      llm.engine.vocab_size)
    dtype = llm.engine.runner.model_dtype  # Hugging Face's default dtype too
    packed = " on the packed kernels (float32 activations)" if llm.engine.runner.bf16_weights_model else ""
    systems: dict[str, Callable[[list[list[int]]], dict[str, float]]] = {
        "splitserve": lambda batch: bench_splitserve(llm, batch, args.output_len)}
    if not args.skip_hf:
        model_dir = llm.engine.runner.model_dir
        for hf_dtype in [getattr(torch, d) for d in args.hf_dtypes.split(",") if d] or [dtype]:
            model = load_hf(model_dir, hf_dtype)
            name = f"hf-generate (static batch {args.hf_batch_size}, {str(hf_dtype).removeprefix('torch.')})"
            systems[name] = partial(bench_hf, model, output_len=args.output_len,
                                    batch_size=args.hf_batch_size, pad_id=0)
    rows = run_rounds(systems, lambda i: prompts(seed=i), args.rounds)
    hf = [r["output_tok_s"] for name, r in rows.items() if name != "splitserve"]
    base = max(hf) if hf else rows["splitserve"]["output_tok_s"]  # Hugging Face at its fastest
    print(f"{args.num_prompts} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens x "
          f"{args.output_len} new tokens, {str(dtype).removeprefix('torch.')}{packed}, "
          f"{kw['num_threads']} threads")
    print(f"{'system':<44} {'seconds':>9} {'out tok/s':>10} {'vs HF':>7}")
    for name, r in rows.items():
        print(f"{name:<44} {r['seconds']:>9.1f} {r['output_tok_s']:>10.1f} "
              f"{r['output_tok_s'] / base:>6.2f}x")
    if args.rounds > 1:
        print("per round, out tok/s: " + "; ".join(
            f"{name} {', '.join(f'{x:.1f}' for x in r['rounds'])}" for name, r in rows.items()))
    if args.json:
        print(json.dumps({"bench": "offline", **{k: v for k, v in rows.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
