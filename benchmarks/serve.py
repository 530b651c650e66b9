"""`splitserve bench serve`: load on any OpenAI-compatible server (splitserve,
vLLM, ...), the same seeded requests for each, and its latency and throughput.

    splitserve bench serve --num-prompts 64 --concurrency 16          # mixed 64-512-word prompts
    splitserve bench serve --workload shared-prefix --prefix-words 1000 --suffix-words 30
    splitserve bench serve --workload long-prompt-interference --request-rate 1 --long-words 4000
    splitserve bench serve --workload replay --dataset trace.jsonl --plot out.png

Prints a table and one JSON line (also appended to --json-out); --plot draws
latency CDFs and throughput over time when matplotlib is installed.  See
benchmarks/README.md for the comparisons.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from benchmarks.serve_client import Progress, Target, auth_headers, run_requests
from benchmarks.serve_stats import RequestResult, format_table, summarize_groups
from benchmarks.serve_workloads import (
    BenchRequest,
    interference_workload,
    load_replay,
    random_workload,
    shared_prefix_workload,
    with_arrivals,
)

WORKLOADS = ("random", "shared-prefix", "long-prompt-interference", "replay")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--workload", choices=WORKLOADS, default="random", help="what the requests look like")
    p.add_argument("--dataset", default=None,
                   help="replay: a JSONL file of {prompt, output_len, arrival_time}")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (short chats in interference)")
    p.add_argument("--input-len-min", type=int, default=64, help="prompt words, at least")
    p.add_argument("--input-len-max", type=int, default=512, help="prompt words, at most")
    p.add_argument("--output-len", type=int, default=128, help="tokens per response (ignore_eos)")
    p.add_argument("--prefix-words", type=int, default=1000, help="shared-prefix: the shared part")
    p.add_argument("--suffix-words", type=int, default=30, help="shared-prefix: each request's own part")
    p.add_argument("--long-words", type=int, default=4000, help="interference: long prompt words")
    p.add_argument("--long-interval", type=float, default=10.0, help="interference: seconds between them")
    p.add_argument("--long-output-len", type=int, default=16, help="interference: long prompts' tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many in flight")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT objective")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="goodput: inter-token objective (per request mean, i.e. TPOT)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--label", default=None, help="name of the system under test, for the JSON line")
    p.add_argument("--json-out", default=None, help="append the JSON line to this file")
    p.add_argument("--plot", default=None, help="draw latency CDFs and throughput to this PNG")
    p.add_argument("--no-progress", action="store_true", help="print no progress line")


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    if args.output_len < 1:
        raise ValueError("--output-len must be >= 1")
    if args.workload == "random":
        reqs = random_workload(args.num_prompts, args.input_len_min, args.input_len_max,
                               args.output_len, args.seed)
    elif args.workload == "shared-prefix":
        reqs = shared_prefix_workload(args.num_prompts, args.prefix_words, args.suffix_words,
                                      args.output_len, args.seed)
    elif args.workload == "long-prompt-interference":
        reqs = interference_workload(args.num_prompts, args.input_len_min, args.input_len_max,
                                     args.output_len, args.request_rate, args.long_words,
                                     args.long_interval, args.long_output_len, args.seed)
    else:
        if not args.dataset:
            raise ValueError("--workload replay needs --dataset FILE.jsonl")
        reqs = load_replay(args.dataset)
    return with_arrivals(reqs, args.request_rate, args.seed)


def server_model(base_url: str, timeout: float = 10.0) -> str:
    import httpx

    try:
        r = httpx.get(f"{base_url}/v1/models", timeout=timeout, headers=auth_headers())
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"cannot read the model from {base_url}/v1/models ({e}); pass --model") from None


def plot_compare(runs: dict[str, tuple[dict[str, Any], list[RequestResult]]], path: str,
                 title: str) -> bool:
    """One workload on several systems: TTFT, ITL and e2e CDFs (a line per
    system, and per request group where the workload has several) and output
    tokens/s over time.  False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (("TTFT", lambda r: [r.ttft]), ("ITL", lambda r: r.itls), ("end to end", lambda r: [r.e2e]))
    for ax, (name, values) in zip(axes.flat, panels, strict=False):
        for label, (_, results) in runs.items():
            ok = [r for r in results if r.ok]
            groups = sorted({r.group for r in ok})
            for g in groups:
                ms = sorted(1000 * v for r in ok if r.group == g for v in values(r))
                if ms:
                    ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], drawstyle="steps-post",
                            label=label if len(groups) == 1 else f"{label}: {g}")
        ax.set(title=f"{name} CDF", xlabel="ms", xscale="log",
               ylabel="fraction of " + ("tokens" if name == "ITL" else "requests"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for label, (summary, results) in runs.items():
        per_second: dict[int, int] = {}
        for r in results:
            if r.ok:
                for t in r.token_times:
                    per_second[int(r.start + t)] = per_second.get(int(r.start + t), 0) + 1
        seconds = range(int(summary["duration_s"]) + 1)
        ax.plot(list(seconds), [per_second.get(s, 0) for s in seconds],
                label=f"{label} (mean {summary['output_throughput']:.1f})")
    ax.set(title="output tokens/s", xlabel="s since start")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def plot(results: list[RequestResult], summary: dict[str, Any], path: str, title: str,
         label: str = "this run") -> bool:
    """Latency CDFs (TTFT, ITL, e2e; per group) and output tokens/s over time
    of one run.  False when matplotlib is not installed (it is not a dependency)."""
    return plot_compare({label: (summary, results)}, path, title)


def describe(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    """The run's parameters, as they go into the JSON line."""
    load = ({"concurrency": args.concurrency} if args.concurrency else {}) | (
        {"request_rate": args.request_rate} if args.request_rate != float("inf") else {})
    d: dict[str, Any] = {"workload": args.workload, "endpoint": args.endpoint, "num_requests": len(requests),
                         "output_len": args.output_len, "seed": args.seed, **load}
    if args.workload in ("random", "long-prompt-interference"):
        d["input_words"] = [args.input_len_min, args.input_len_max]
    if args.workload == "shared-prefix":
        d.update(prefix_words=args.prefix_words, suffix_words=args.suffix_words)
    if args.workload == "long-prompt-interference":
        d.update(long_words=args.long_words, long_interval=args.long_interval)
    if args.workload == "replay":
        d["dataset"] = args.dataset
    return d


def build_parser() -> argparse.ArgumentParser:
    from services.help_format import with_defaults

    p = argparse.ArgumentParser(prog="splitserve bench serve",
                                description="latency and throughput of any OpenAI-compatible server")
    add_serve_args(p)
    with_defaults(p)
    return p


def main(argv: list[str] | None = None) -> int:
    summary, _ = measure(build_parser().parse_args(argv))
    return 0 if summary["completed"] else 1


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestResult]]:
    """Run the workload against the server; print and return the summary and
    the per-request results (in request order)."""
    base = args.base_url.rstrip("/").removesuffix("/v1")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    requests = build_workload(args)
    model = args.model or server_model(base)
    target = Target(f"{base}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}",
                    model, chat=args.endpoint == "chat", temperature=args.temperature)
    params = describe(args, requests)
    print(f"bench serve: {base} model {model}, {json.dumps(params)}", file=sys.stderr, flush=True)
    progress = Progress(len(requests), enabled=not args.no_progress)
    results, duration = asyncio.run(run_requests(target, requests, args.concurrency, args.timeout, progress))
    summary = summarize_groups(results, duration, args.slo_ttft_ms, args.slo_itl_ms)
    errors = sorted({r.error for r in results if not r.ok})
    title = f"{args.label or model} @ {base}: {args.workload}"
    print(format_table(summary, title))
    for e in errors[:5]:
        print(f"  error: {e}")
    line = json.dumps({"bench": "serve", "label": args.label, "base_url": base, "model": model,
                       **params, **summary, "errors": errors[:5]})
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")
    if args.plot and not plot(results, summary, args.plot, title, args.label or model):
        print("bench serve: matplotlib is not installed; no plot (pip install matplotlib)", file=sys.stderr)
    return summary, results


if __name__ == "__main__":
    raise SystemExit(main())
