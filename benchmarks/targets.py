"""The performance targets of benchmarks/README.md, measured in one run.

Each serving number comes from `splitserve bench serve` against a running
server; each comparison runs its systems back to back in this one process, on
the same weights and dtype:

1. mixed workload: colocated and disaggregated splitserve vs vLLM (CPU)
2. single-stream decode vs vLLM
3. shared prefix: TTFT of the requests after the first vs the first's
4. long-prompt interference: short chats' ITL p99, disaggregated vs colocated
5. batched decode at concurrency 32 as a fraction of the measured matmul peak
6. offline throughput vs Hugging Face static batching (`splitserve bench offline`)
7. cold start of `splitserve up --prefill 1 --decode 1` (and of vLLM)

    python -m benchmarks.targets [--vllm-python /tmp/vllm-venv/bin/python] [--only 1,2,7] [--quick]

vLLM runs only with --vllm-python (its own virtualenv: see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """Seconds until `url` answers 200 (the process must stay up meanwhile)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up after {timeout:.0f} s")


class Server:
    """A server process on free loopback ports, stopped (with its children) on exit."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str] | None = None,
                 health: str = "/health", timeout: float = 900.0, log: Path | None = None) -> None:
        self.label, self.argv = label, argv
        self.url = argv[argv.index("--port") + 1]
        self.url = f"http://127.0.0.1:{self.url}"
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(self.url + health, self.proc, timeout)
            # ready means it answers a completion, not just /health
            httpx.post(self.url + "/v1/completions", timeout=timeout,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 1}).raise_for_status()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def splitserve_up(prefill: int, decode: int, log: Path) -> Server:
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", str(prefill), "--decode", str(decode),
            "--port", str(free_port()), "--grpc-port", str(free_port())]
    return Server(f"splitserve {prefill}p+{decode}d", argv, log=log)


def vllm_up(python: str, model_dir: Path, log: Path) -> Server:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--dtype", "float32", "--enable-prefix-caching",
            "--port", str(free_port())]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    return Server("vllm-cpu", argv, env=env, health="/v1/models", timeout=1200.0, log=log)


# The workloads, as `splitserve bench serve` flags.
WORKLOADS: dict[str, list[str]] = {
    "mixed": ["--num-prompts", "64", "--input-len-min", "64", "--input-len-max", "512",
              "--output-len", "128", "--concurrency", "16"],
    "single": ["--num-prompts", "4", "--input-len-min", "256", "--input-len-max", "256",
               "--output-len", "256", "--concurrency", "1"],
    "shared-prefix": ["--workload", "shared-prefix", "--num-prompts", "16", "--prefix-words", "1000",
                      "--suffix-words", "30", "--output-len", "16", "--concurrency", "1"],
    "interference": ["--workload", "long-prompt-interference", "--num-prompts", "40", "--request-rate", "1",
                     "--input-len-min", "32", "--input-len-max", "128", "--output-len", "64",
                     "--long-words", "4000", "--long-interval", "15", "--long-output-len", "8"],
    "batch32": ["--num-prompts", "64", "--input-len-min", "32", "--input-len-max", "64",
                "--output-len", "128", "--concurrency", "32"],
}
QUICK: dict[str, list[str]] = {
    "mixed": ["--num-prompts", "16", "--output-len", "32", "--concurrency", "8"],
    "single": ["--num-prompts", "2", "--output-len", "64"],
    "shared-prefix": ["--num-prompts", "6"],
    "interference": ["--num-prompts", "16", "--long-words", "2000", "--long-interval", "10"],
    "batch32": ["--num-prompts", "32", "--output-len", "48"],
}


class Runner:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.results: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, tuple[dict[str, Any], list[Any]]]] = {}  # workload -> label -> run
        self.commands: list[str] = []

    def bench(self, server: Server, workload: str) -> tuple[dict[str, Any], list[Any]]:
        from benchmarks.serve import add_serve_args, measure

        flags = WORKLOADS[workload] + (QUICK[workload] if self.args.quick else [])
        flags += ["--no-progress", "--label", server.label, "--json-out", str(self.out / "runs.jsonl")]
        self.commands.append(f"splitserve bench serve --base-url {server.url} "
                             + shlex.join(f for f in flags if f != "--no-progress"))
        p = argparse.ArgumentParser()
        add_serve_args(p)
        a = p.parse_args(["--base-url", server.url, *flags])
        print(f"\n== {server.label}: {workload}", flush=True)
        summary, results = measure(a)
        if summary["failed"]:
            raise RuntimeError(f"{server.label} {workload}: {summary['failed']} requests failed")
        self.results[f"{server.label} / {workload}"] = summary
        self.runs.setdefault(workload, {})[server.label] = (summary, results)
        return summary, results

    def plots(self) -> list[Path]:
        """A picture per workload measured on more than one system."""
        from benchmarks.serve import plot_compare

        drawn = []
        for workload, runs in self.runs.items():
            if len(runs) > 1:
                path = self.out / f"{workload}.png"
                if not plot_compare(runs, str(path), f"{workload}: {', '.join(runs)}"):
                    print("targets: matplotlib is not installed; no plots", file=sys.stderr)
                    return []
                drawn.append(path)
        return drawn


def matmul_peak(threads: int) -> dict[str, float]:
    """Best FLOP/s of one large matmul in float32 (torch's BLAS and the packed
    kernel) and bfloat16, on all of `threads`."""
    import torch

    from engine.layers.cpu_attention import load_linear_kernel

    torch.set_num_threads(threads)
    m, k, n = 512, 576, 3072
    x, w = torch.randn(m, k), torch.randn(n, k)
    kernel = load_linear_kernel()
    xb, wb = x.bfloat16(), w.bfloat16()
    runs: dict[str, Any] = {
        "float32 torch": lambda: torch.nn.functional.linear(x, w),
        "bfloat16 torch": lambda: torch.nn.functional.linear(xb, wb),
    }
    if kernel is not None:
        panels = kernel.pack_weight(w)
        runs["float32 packed kernel"] = lambda: kernel.packed_linear(x, panels, n)
    best: dict[str, float] = {}
    for name, f in runs.items():
        f()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(5):
                f()
            times.append((time.perf_counter() - t) / 5)
        best[name] = 2 * m * k * n / min(times)
    return best


def model_params() -> int:
    """Weights a token multiplies: every projection and the head."""
    from engine.models.llama import LlamaSpec
    from engine.models.loader import resolve_model

    s = LlamaSpec.from_hf(json.loads((resolve_model(None) / "config.json").read_text()))
    h, d = s.hidden_size, s.head_dim
    per_layer = h * (s.num_heads + 2 * s.num_kv_heads) * d + s.num_heads * d * h + 3 * h * s.intermediate_size
    return s.num_layers * per_layer + h * s.vocab_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu installed")
    p.add_argument("--hf-dir", default="/tmp/smollm2-hf", help="the model as a HF directory (for vLLM)")
    p.add_argument("--only", default="1,2,3,4,5,6,7", help="targets to measure")
    p.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    p.add_argument("--out", default=None, help="directory for logs and runs.jsonl")
    args = p.parse_args()
    only = {int(t) for t in args.only.split(",")}
    out = Path(args.out or tempfile.mkdtemp(prefix="splitserve-targets-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"logs and runs.jsonl in {out}", flush=True)
    r = Runner(args, out)
    report: list[str] = []
    threads = os.cpu_count() or 1

    if 5 in only:
        peak = matmul_peak(threads)
        report.append("matmul peak (512x576x3072): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s"
                                                                for k, v in peak.items()))

    if only & {1, 4, 7}:
        with splitserve_up(1, 1, out / "up-disagg.log") as disagg:
            if 7 in only:
                report.append(f"7. cold start, splitserve up --prefill 1 --decode 1: healthy and serving "
                              f"in {disagg.start_s:.1f} s (target <= 10 s)")
            if 1 in only:
                r.bench(disagg, "mixed")
            if 4 in only:
                _, res = r.bench(disagg, "interference")
    if only & {1, 2, 3, 4, 5}:
        with splitserve_up(0, 1, out / "up-coloc.log") as coloc:
            plan = ((1, "mixed"), (2, "single"), (3, "shared-prefix"), (4, "interference"), (5, "batch32"))
            for t, w in plan:
                if t not in only:
                    continue
                s, res = r.bench(coloc, w)
                if t == 3:
                    first, rest = res[0].ttft, [x.ttft for x in res[1:]]
                    ratio = statistics.median(rest) / first
                    report.append(f"3. shared prefix: first TTFT {first * 1e3:.0f} ms, later TTFT p50 "
                                  f"{statistics.median(rest) * 1e3:.0f} ms = {ratio:.3f}x (target <= 0.25x)")
                if t == 5:
                    tps = 32 / (s["tpot_ms"]["p50"] / 1e3)  # decode tokens/s with 32 sequences running
                    flops = 2 * model_params() * tps
                    best = max(peak.values())
                    report.append(f"5. batched decode at concurrency 32: {tps:.0f} tok/s = {flops / 1e9:.1f} "
                                  f"GFLOP/s = {flops / best:.0%} of the measured peak {best / 1e9:.1f} "
                                  f"GFLOP/s (target >= 40%)")
    if args.vllm_python and only & {1, 2, 7}:
        hf = Path(args.hf_dir)
        if not (hf / "config.json").exists():
            subprocess.run([sys.executable, "-m", "services.cli", "export-hf", str(hf)], cwd=ROOT, check=True)
        with vllm_up(args.vllm_python, hf, out / "vllm.log") as vllm:
            if 7 in only:
                report.append(f"7. cold start, vLLM CPU: serving in {vllm.start_s:.1f} s")
            for t, w in ((1, "mixed"), (2, "single")):
                if t in only:
                    r.bench(vllm, w)

    done = r.results
    if 1 in only:
        def tput(label: str) -> float | None:
            return done[label]["output_throughput"] if label in done else None
        c, d, v = (tput(f"{x} / mixed") for x in ("splitserve 0p+1d", "splitserve 1p+1d", "vllm-cpu"))
        assert c is not None and d is not None
        line = f"1. mixed: colocated {c:.1f} tok/s, disaggregated {d:.1f} tok/s"
        if v:
            line += (f", vLLM {v:.1f} tok/s: colocated {c / v:.2f}x (target 1.5x), "
                     f"disaggregated {d / v:.2f}x (1.0x)")
        report.append(line)
    if 2 in only:
        c2 = done["splitserve 0p+1d / single"]["output_throughput"]
        line = f"2. single stream: splitserve {c2:.1f} tok/s"
        if "vllm-cpu / single" in done:
            v2 = done["vllm-cpu / single"]["output_throughput"]
            line += f", vLLM {v2:.1f} tok/s = {c2 / v2:.2f}x (target 2.5x)"
        report.append(line)
    if 4 in only:
        def short_itl(label: str) -> float:
            return done[label]["groups"]["short"]["itl_ms"]["p99"]
        d4, c4 = short_itl("splitserve 1p+1d / interference"), short_itl("splitserve 0p+1d / interference")
        report.append(f"4. interference: short chats' ITL p99 disaggregated {d4:.0f} ms, "
                      f"colocated {c4:.0f} ms "
                      f"= {d4 / c4:.2f}x (target <= 0.5x)")
    if 6 in only:
        cmd = [sys.executable, "-m", "services.cli", "bench", "offline", "--json"]
        if args.quick:
            cmd += ["--num-prompts", "16"]
        r.commands.append("splitserve bench offline --json" + (" --num-prompts 16" if args.quick else ""))
        print("\n== offline", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        print(proc.stdout, flush=True)
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        ours = rows["splitserve"]["output_tok_s"]
        hf = next(v["output_tok_s"] for k, v in rows.items() if k.startswith("hf-generate"))
        report.append(f"6. offline: splitserve {ours:.1f} tok/s, HF static batch 16 {hf:.1f} tok/s "
                      f"= {ours / hf:.2f}x (target 3x)")

    print("\n== commands")
    print("\n".join(r.commands))
    print("\n== targets")
    print("\n".join(sorted(report)))
    (out / "report.txt").write_text("\n".join(sorted(report)) + "\n")
    for path in r.plots():
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
