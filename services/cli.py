"""The `splitserve` command.

    splitserve up        start the stack: frontend + prefill and decode workers
    splitserve frontend | prefill | decode   run one service (what compose uses)
    splitserve chat      chat with the model in the terminal (offline engine)
    splitserve generate  complete one prompt
    splitserve bench offline   offline throughput vs Hugging Face static batching
    splitserve bench serve     latency and throughput of any OpenAI-compatible server
    splitserve export-hf DIR   the model as a Hugging Face directory (for transformers, vLLM)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from services.help_format import with_defaults


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on GPUs and CPUs with native bf16, else float32")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when there is a GPU)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", type=float, default=0.25,
                   help="KV budget: a fraction of free memory (<= 1) or bytes (> 1)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache storage: auto (the model's dtype) or fp8, half a bfloat16 cache "
                        "(twice the blocks, half the bytes sent to decode); prefill and decode must agree")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context)")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens in one engine step (longer prompts are prefilled in chunks)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: first come first served; priority: lower `priority` first, preempting")
    g.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached prompt blocks")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--seed", type=int, default=0, help="seed of requests that bring none")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                scheduling_policy=args.scheduling_policy,
                enable_prefix_caching=not args.no_prefix_caching,
                num_threads=args.num_threads, seed=args.seed)


def cmd_chat(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print("splitserve chat: type a message, an empty line or Ctrl-D to quit.")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        history.append({"role": "user", "content": line.strip()})
        out = llm.chat(history, params)[0].outputs[0]
        history.append({"role": "assistant", "content": out.text})
        print(out.text.strip(), flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    print(llm.generate(args.prompt, params)[0].outputs[0].text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from benchmarks.offline import main as bench_offline

    return bench_offline(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from benchmarks.serve import main as bench_serve

    return bench_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve")
    sub = parser.add_subparsers(dest="command", required=True)
    from services.launcher import add_up_args, cmd_up

    up = sub.add_parser("up", help="start the stack on this machine")
    add_engine_args(up)
    add_up_args(up)
    up.set_defaults(fn=cmd_up)
    for role in SERVICES:
        sub.add_parser(role, help=f"run one {role} service (see `splitserve {role} --help`)",
                       add_help=False)
    for name, fn, help_ in (("chat", cmd_chat, "chat with the model in the terminal"),
                            ("generate", cmd_generate, "complete one prompt")):
        p = sub.add_parser(name, help=help_)
        add_engine_args(p)
        p.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
        p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
        p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
        if name == "generate":
            p.add_argument("prompt")
        p.set_defaults(fn=fn)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    off = bsub.add_parser("offline", help="offline throughput vs Hugging Face static batching")
    add_engine_args(off)
    off.add_argument("--num-prompts", type=int, default=64, help="prompts in the batch")
    off.add_argument("--min-prompt-len", type=int, default=64, help="shortest prompt, tokens")
    off.add_argument("--max-prompt-len", type=int, default=512, help="longest prompt, tokens")
    off.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt")
    off.add_argument("--hf-batch-size", type=int, default=16, help="Hugging Face generate's static batch")
    off.add_argument("--skip-hf", action="store_true", help="measure splitserve only")
    off.add_argument("--json", action="store_true", help="also print one JSON line")
    off.set_defaults(fn=cmd_bench)
    from benchmarks.serve import add_serve_args
    from services.export_hf import add_export_args, cmd_export_hf

    srv = bsub.add_parser("serve", help="latency and throughput of any OpenAI-compatible server")
    add_serve_args(srv)
    srv.set_defaults(fn=cmd_bench_serve)
    exp = sub.add_parser("export-hf", help="save the model as a Hugging Face directory")
    add_export_args(exp)
    exp.set_defaults(fn=cmd_export_hf)
    with_defaults(parser)
    return parser


SERVICES = ("frontend", "prefill", "decode")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        import importlib

        return int(importlib.import_module(f"services.{argv[0]}.__main__").main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ValueError as e:
        print(f"splitserve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
