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
import importlib
import sys

from services.help_format import with_defaults
from services.worker_flags import add_engine_args, engine_kwargs

__all__ = ["add_engine_args", "build_parser", "engine_kwargs", "main"]  # engine flags: worker_flags.py


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


# `splitserve bench NAME ...` runs benchmarks/NAME.py, found by name as
# `python -m` would find it: the product does not import the benchmarks
# (docs/ARCHITECTURE.md), and each benchmark owns its flags.
BENCHMARKS = {"offline": "offline throughput vs Hugging Face static batching",
              "serve": "latency and throughput of any OpenAI-compatible server"}


def run_benchmark(name: str, argv: list[str]) -> int:
    benchmark = importlib.import_module(f"benchmarks.{name}")
    return int(benchmark.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve")
    sub = parser.add_subparsers(dest="command", required=True)
    from services.launcher import add_up_args, cmd_up

    up = sub.add_parser("up", help="start the stack on this machine")
    add_engine_args(up)
    add_up_args(up)
    # Unless given, each worker takes its role's own step size (a prefill worker's is smaller).
    up.set_defaults(fn=cmd_up, max_num_batched_tokens=None)
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
    bench = sub.add_parser("bench", help="benchmarks (see `splitserve bench NAME --help`)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_ in BENCHMARKS.items():
        bsub.add_parser(name, help=help_, add_help=False)
    from services.export_hf import add_export_args, cmd_export_hf

    exp = sub.add_parser("export-hf", help="save the model as a Hugging Face directory")
    add_export_args(exp)
    exp.set_defaults(fn=cmd_export_hf)
    with_defaults(parser)
    return parser


SERVICES = ("frontend", "prefill", "decode")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        return int(importlib.import_module(f"services.{argv[0]}.__main__").main(argv[1:]) or 0)
    bench = len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHMARKS
    args = None if bench else build_parser().parse_args(argv)
    try:
        if args is None:
            return run_benchmark(argv[1], argv[2:])
        return int(args.fn(args) or 0)
    except ValueError as e:
        print(f"splitserve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
