"""The performance targets of issue 16, measured in one run, each system at
its best dtype for this machine, side by side:

1. mixed workload: colocated >= 1.5x vLLM, disaggregated (1 prefill + 1
   decode) >= 1.0x vLLM
2. single stream: >= 1.5x vLLM, and at least llama.cpp's llama-server on the
   same GGUF
3. batched decode at concurrency 32: >= 50% of the measured matmul peak of the
   dtype the server runs (32 requests arriving together, so that every step
   after their prompts is a decode of 32; three rounds (two with --quick),
   each held to the peak measured right before and after it, the verdict by
   the median round; a second run, where 64 requests keep 32 in flight and
   new prompts are prefilled between the decodes, is reported beside it)
4. prefill of a 2,000-token prompt: >= 60% of that peak (the better of the
   peaks measured right before and right after it)
5. cold start of `splitserve up --prefill 1 --decode 1` <= 10 s (a start
   after the machine's first, which builds the kernels and packs the
   weights once, and is reported beside it); offline
   throughput >= 3x Hugging Face static batching (`splitserve bench offline`)

Each serving number comes from `splitserve bench serve` against a running
server.  splitserve runs in float32 and, where the CPU has native bf16, in
bfloat16 too (the disaggregated stack in `--dtype auto`); vLLM in bf16 where
native, float32 elsewhere; llama.cpp on the model's own GGUF.  The report names the CPU and
its flags and says per target "met" or "not met" (or what was not measured).

    python -m benchmarks.targets [--vllm-python /tmp/vllm-venv/bin/python]
        [--llama-server /tmp/llama-venv/bin/llama-server] [--only 1,2,5] [--quick]

vLLM and llama.cpp run only when named (their installs: benchmarks/README.md).
llama.cpp's server runs beside ours, and the single stream alternates between
the two request by request, so that the host's drifting speed (20% and more
over minutes on a shared machine) weighs on both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def peer_environ() -> dict[str, str]:
    """This process's environment as it was before the engine's import set
    OMP_WAIT_POLICY for its own kernels (engine/__init__.py).  The peers must
    not inherit it: under a passive wait, llama.cpp's OpenMP threads sleep
    between the ops of a token (33 against 10 ms a token on a Zen 5), and vLLM's
    CPU build runs on OpenMP too.  splitserve's own workers set it again."""
    import engine

    env = dict(os.environ)
    if engine.OMP_WAIT_POLICY_BEFORE is None:
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = engine.OMP_WAIT_POLICY_BEFORE
    return env


class Server:
    """A server process on free loopback ports, stopped (with its children) on exit."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str] | None = None,
                 health: str = "/health", timeout: float = 900.0, log: Path | None = None) -> None:
        self.label, self.argv = label, argv
        self.url = argv[argv.index("--port") + 1]
        self.url = f"http://127.0.0.1:{self.url}"
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**peer_environ(), **(env or {})}, stdout=out,
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


def splitserve_up(prefill: int, decode: int, log: Path, dtype: str = "auto", kv: str = "auto",
                  prompts: str = "auto", decodes: str = "auto") -> Server:
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", str(prefill), "--decode", str(decode),
            "--dtype", dtype, "--kv-cache-dtype", kv, "--prefill-dtype", prompts, "--decode-dtype", decodes,
            "--port", str(free_port()), "--grpc-port", str(free_port())]
    label = (f"splitserve {prefill}p+{decode}d" + ("" if dtype == "auto" else f" {dtype}")
             + ("" if kv == "auto" else f" kv {kv}") + ("" if prompts == "auto" else f" prefill {prompts}")
             + ("" if decodes == "auto" else f" decode {decodes}"))
    return Server(label, argv, log=log)


def vllm_up(python: str, model_dir: Path, dtype: str, log: Path) -> Server:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--dtype", dtype, "--enable-prefix-caching",
            "--port", str(free_port())]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    return Server(f"vllm-cpu {dtype}", argv, env=env, health="/v1/models", timeout=1200.0, log=log)


def llama_up(binary: str, gguf: Path, log: Path) -> Server:
    """llama.cpp's server on the GGUF the default model is converted from, 16
    slots (as in issue 16's measurement), on every core."""
    argv = [binary, "-m", str(gguf), "--alias", MODEL, "--host", "127.0.0.1", "--port", str(free_port()),
            "-np", "16", "-c", "16384", "-t", str(os.cpu_count() or 1)]
    return Server("llama.cpp", argv, health="/health", timeout=300.0, log=log)


# The workloads, as `splitserve bench serve` flags.
WORKLOADS: dict[str, list[str]] = {
    "mixed": ["--num-prompts", "64", "--input-len-min", "64", "--input-len-max", "512",
              "--output-len", "128", "--concurrency", "16"],
    "single": ["--num-prompts", "4", "--input-len-min", "256", "--input-len-max", "256",
               "--output-len", "256", "--concurrency", "1"],
    "decode32": ["--num-prompts", "32", "--input-len-min", "32", "--input-len-max", "64",
                 "--output-len", "128", "--concurrency", "32"],
    "batch32": ["--num-prompts", "64", "--input-len-min", "32", "--input-len-max", "64",
                "--output-len", "128", "--concurrency", "32"],
}
QUICK: dict[str, list[str]] = {
    "mixed": ["--num-prompts", "16", "--output-len", "32", "--concurrency", "8"],
    "single": ["--num-prompts", "2", "--output-len", "64"],
    "decode32": ["--output-len", "48"],
    "batch32": ["--num-prompts", "32", "--output-len", "48"],
}
PREFILL_TOKENS = 2000
# Target 3's rounds of decode32, each between two measurements of the peak;
# the verdict goes by the median round.
DECODE_ROUNDS, DECODE_ROUNDS_QUICK = 3, 2


class Runner:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.results: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, tuple[dict[str, Any], list[Any]]]] = {}  # workload -> label -> run
        self.commands: list[str] = []
        # workload -> the next seed no server has seen: a later pairing on the
        # same peer must not find its prompts in the peer's prefix cache
        self.fresh_seed: dict[str, int] = {}

    def flags(self, workload: str) -> list[str]:
        return WORKLOADS[workload] + (QUICK[workload] if self.args.quick else [])

    def bench(self, server: Server, workload: str,
              extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[Any]]:
        from benchmarks.serve import add_serve_args, measure

        flags = self.flags(workload) + list(extra)
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

    def bench_paired(self, servers: list[Server], workload: str) -> dict[str, dict[str, Any]]:
        """The workload's requests one at a time, each sent to every server in
        turn, so that a drifting host speed (20% and more over minutes on a
        shared machine) weighs on every server alike: request i is the
        workload's request with seed i (counted on from the last pairing's),
        the same prompt for all.  No server serves two requests in a row: one
        right after its own ran 15-30% faster than one after another server's
        (its weights still in cache; session 29), so each round's order is
        the last one's rotated by one (A B C, B C A, ...; two servers: A B, A B).
        -> label -> the summary of its requests."""
        flags = self.flags(workload)
        given = [v for f, v in zip(flags, flags[1:], strict=False) if f == "--num-prompts"]
        n = int(given[-1])  # the last one counts (--quick adds its own)
        return self._pooled(servers, workload, n, ("--num-prompts", "1"), rotate=True)

    def bench_abba(self, servers: list[Server], workload: str, rounds: int = 2) -> dict[str, dict[str, Any]]:
        """The whole workload `rounds` times on each server, each round on new
        prompts (a seed of its own: none in a prefix cache), every
        other round in reverse order (A B, B A): a host whose speed drifts over
        the minutes weighs on every server alike, where one run each would
        charge the drift to whichever ran later.  (A workload with concurrency
        keeps it: pairing it request by request would change the workload.)
        -> label -> the summary over its rounds' requests."""
        return self._pooled(servers, workload, rounds if len(servers) > 1 else 1, ())

    def _pooled(self, servers: list[Server], workload: str, rounds: int, extra: tuple[str, ...],
                rotate: bool = False) -> dict[str, dict[str, Any]]:
        """Round i: the workload with `extra` and a seed of its own on each
        server (the same for all; none an earlier pairing used), every other
        round in reverse order, or with `rotate` each round's order rotated by
        one from the last's (the same order each round for two servers) ->
        label -> the summary of all its rounds' requests over their summed durations."""
        from benchmarks.serve_stats import summarize_groups

        first = self.fresh_seed.get(workload, 0)
        self.fresh_seed[workload] = first + rounds
        got: dict[str, tuple[list[Any], float]] = {s.label: ([], 0.0) for s in servers}
        for i in range(rounds):
            if rotate:
                shift = i % len(servers) if len(servers) > 2 else 0
                order = servers[shift:] + servers[:shift]
            else:
                order = servers if i % 2 == 0 else servers[::-1]
            for server in order:
                summary, results = self.bench(server, workload, (*extra, "--seed", str(first + i)))
                done, seconds = got[server.label]
                got[server.label] = (done + results, seconds + summary["duration_s"])
        out = {}
        for label, (results, seconds) in got.items():
            summary = summarize_groups(results, seconds)
            self.results[f"{label} / {workload}"] = summary
            self.runs.setdefault(workload, {})[label] = (summary, results)
            out[label] = summary
        return out

    def bench_beside_peak(self, server: Server, workload: str, rounds: int,
                          peak: Callable[[], dict[str, float]]) -> list[PeakRound]:
        """The workload `rounds` times on `server`, each round on new prompts,
        with the machine's matmul peak measured before the first round, between
        rounds and after the last: a fraction of the peak compares a rate with
        the peak of the same minutes.  A shared host's speed moves by 15% and
        more from one minute to the next (Zen 4, session 36: a decode step of
        32 sequences 35 or 41 ms for a minute at a time, the peak 425 or 400
        GFLOP/s with it), so a peak measured at the run's start or end could
        hold the workload to a faster or a slower machine than it ran on.
        Stores the rounds pooled, as bench_abba does -> each round with the
        peaks measured right before and right after it."""
        from benchmarks.serve_stats import summarize_groups

        first = self.fresh_seed.get(workload, 0)
        self.fresh_seed[workload] = first + rounds
        peaks = [peak()]
        runs: list[tuple[dict[str, Any], list[Any]]] = []
        for i in range(rounds):
            runs.append(self.bench(server, workload, ("--seed", str(first + i))))
            peaks.append(peak())
        results = [x for _, done in runs for x in done]
        summary = summarize_groups(results, sum(s["duration_s"] for s, _ in runs))
        self.results[f"{server.label} / {workload}"] = summary
        self.runs.setdefault(workload, {})[server.label] = (summary, results)
        return [PeakRound(s, peaks[i], peaks[i + 1]) for i, (s, _) in enumerate(runs)]

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


def cpu_line() -> str:
    """The CPU's model, family/model numbers, core count and kernel flags."""
    from engine.layers.cpu_features import cpu_summary

    ids = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("cpu family", "model") and key.strip() not in ids:
                    ids[key.strip()] = value.strip()
                if len(ids) == 2:
                    break
    except OSError:
        pass
    fam = f" (family {ids['cpu family']} model {ids['model']})" if len(ids) == 2 else ""
    return cpu_summary().replace(",", fam + ",", 1)


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
        if kernel.bf16_supported():  # the prompts' kernel under --prefill-dtype bfloat16
            bf = kernel.pack_bf16(w)
            runs["bfloat16 packed kernel"] = lambda: kernel.bf16_linear(x, bf, n)
        # --decode-dtype int8's kernel: 4-bit blocks times int8 inputs
        from engine.layers.packed_linear import q4_layout

        q4 = q4_layout(torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 32) * 0.01,
                       torch.randn(n, k // 32) * 0.01)
        runs["int8 packed kernel"] = lambda: kernel.q4i8_linear(x, q4, n)
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


def better_peaks(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each matmul's better peak of two measurements (a low one would flatter every fraction of it)."""
    return {k: max(v, after.get(k, 0.0)) for k, v in before.items()}


def dtype_peak(peak: dict[str, float], dtype: str) -> tuple[str, float]:
    """The peak a server of `dtype` is held to: the best float32 matmul, bf16's, or int8's."""
    rows = {k: v for k, v in peak.items() if k.startswith(dtype)}
    name = max(rows, key=lambda k: rows[k])
    return name, rows[name]


def served_dtype(dtype: str) -> str:
    """The dtype a server started with `--dtype dtype` runs (auto resolved as
    the workers resolve it, for a server's default batch size)."""
    import torch

    from engine.model_runner import resolve_dtype

    resolved = resolve_dtype(dtype, torch.device("cpu"))
    return str(resolved).removeprefix("torch.")


def model_shape() -> tuple[int, int, int]:
    """(weights a token multiplies: every projection and the head; layers; query heads x head dim)."""
    from engine.models.llama import LlamaSpec
    from engine.models.loader import resolve_model

    s = LlamaSpec.from_hf(json.loads((resolve_model(None) / "config.json").read_text()))
    h, d = s.hidden_size, s.head_dim
    per_layer = h * (s.num_heads + 2 * s.num_kv_heads) * d + s.num_heads * d * h + 3 * h * s.intermediate_size
    return s.num_layers * per_layer + h * s.vocab_size, s.num_layers, s.num_heads * d


def decode_rate(s: dict[str, Any], params: int, layers: int, qdim: int) -> tuple[float, float, float]:
    """A concurrency-32 run's (decode tokens/s with 32 sequences running,
    their FLOP/s, the machine's FLOP/s over the whole run, prompts included).
    A token's FLOPs: the weights it multiplies and its attention over the
    context (as target 4 counts them), a decode at the run's mean context."""
    n_out = s["output_tokens"] / s["completed"]
    prompt = s["input_tokens"] / s["completed"]
    per_token = 2 * params + 4 * layers * qdim * (prompt + n_out / 2)
    tps = 32 / (s["tpot_ms"]["p50"] / 1e3)
    work = s["input_tokens"] * (2 * params + 2 * layers * qdim * prompt) + s["output_tokens"] * per_token
    return tps, per_token * tps, work / s["duration_s"]


@dataclass(frozen=True)
class PeakRound:
    """One round of a workload and the matmul peaks measured right before and after it."""
    summary: dict[str, Any]
    peak_before: dict[str, float]
    peak_after: dict[str, float]

    def peak(self, dtype: str) -> tuple[str, float]:
        """The better of the two (better_peaks), as dtype_peak picks."""
        return dtype_peak(better_peaks(self.peak_before, self.peak_after), dtype)


def decode_fractions(rounds: list[PeakRound], dtype: str, params: int, layers: int,
                     qdim: int) -> list[float]:
    """Each round's decode FLOP/s (decode_rate) over the peak of its own minutes."""
    return [decode_rate(r.summary, params, layers, qdim)[1] / r.peak(dtype)[1] for r in rounds]


def prefill_seconds(server: Server, tokens: int, runs: int = 3) -> float:
    """Median time of a completion of one token after a `tokens`-token prompt
    (token ids, each run new, so no prefix cache hit).  One client for every
    run, made before the clock starts: a new httpx client per request builds
    its TLS context first, about 25 ms of the client's own (Intel Xeon, family
    6 model 207: a 10-token prompt's round trip took 44-55 ms that way, 17-22
    with the client kept), which is not the server's prefill."""
    import random

    times = []
    with httpx.Client(timeout=600) as http:
        for i in range(runs):
            rng = random.Random(1000 + i)
            ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
            t = time.perf_counter()
            r = http.post(f"{server.url}/v1/completions",
                          json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "not met")


def main() -> int:
    from engine.layers.cpu_features import fast_bf16

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu installed")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--hf-dir", default="/tmp/smollm2-hf", help="the model as a HF directory (for vLLM)")
    p.add_argument("--only", default="1,2,3,4,5", help="targets to measure")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="splitserve's KV cache dtype (auto: the model's; bfloat16 or float16 halves a "
                        "float32 model's)")
    p.add_argument("--prefill-dtype", default="auto",
                   help="splitserve's prefill dtype (bfloat16: a float32 model's prompt tokens through "
                        "bfloat16 projections; prefill is then held to the bfloat16 peak)")
    p.add_argument("--decode-dtype", default="auto",
                   help="splitserve's decode dtype (int8: a float32 model's generated tokens through "
                        "its 4-bit layers with int8 inputs, batched decode then held to the int8 peak; "
                        "bfloat16: with bfloat16 inputs, held to the bfloat16 peak; bfloat16-weights: "
                        "through bfloat16 panels of every projection and the head, held to the "
                        "bfloat16 peak)")
    p.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    p.add_argument("--out", default=None, help="directory for logs and runs.jsonl")
    args = p.parse_args()
    only = {int(t) for t in args.only.split(",")}
    out = Path(args.out or tempfile.mkdtemp(prefix="splitserve-targets-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"logs and runs.jsonl in {out}", flush=True)
    cpu = cpu_line()
    print(f"CPU: {cpu}", flush=True)
    r = Runner(args, out)
    report: list[str] = []
    threads = os.cpu_count() or 1
    native = fast_bf16()
    # The peak is measured again after the servers (below) and the better of
    # the two kept: on a shared host one slow moment would otherwise make a
    # low peak, and every fraction of it look high.
    peak_before = matmul_peak(threads) if only & {3, 4} else {}
    params, layers, qdim = model_shape()
    ours: dict[str, str] = {}  # label -> dtype it serves
    prompts_in: dict[str, str] = {}  # label -> dtype its prompts compute in
    decodes_in: dict[str, str] = {}  # label -> dtype its generated tokens compute in
    decode_rounds: dict[str, list[PeakRound]] = {}  # label -> target 3's rounds
    disagg_label = ""

    # The dtype=auto stacks' decodes (the split and offline): --decode-dtype is a float32 option.
    auto_decodes = args.decode_dtype if served_dtype("auto") == "float32" else "auto"
    vllm_dtype = "bfloat16" if native else "float32"
    # The peers stay up beside each of our stacks (idle but for their turns), so
    # that every comparison alternates: the mixed workload A B B A with vLLM,
    # the single stream request by request with vLLM and llama.cpp.
    beside: dict[str, dict[str, dict[str, Any]]] = {}  # our label -> peer label / workload -> summary

    def against(ours_: Server, peers_: list[Server], workload: str) -> None:
        if workload == "single":
            got = r.bench_paired([ours_, *peers_], workload)
        else:
            got = r.bench_abba([ours_, *peers_], workload)
        for peer in peers_:
            beside.setdefault(ours_.label, {})[f"{peer.label} / {workload}"] = got[peer.label]

    with contextlib.ExitStack() as peers:
        vllm: Server | None = None
        if args.vllm_python and only & {1, 2, 5}:
            hf = Path(args.hf_dir)
            if not (hf / "config.json").exists():
                subprocess.run([sys.executable, "-m", "services.cli", "export-hf", str(hf)], cwd=ROOT,
                               check=True)
            vllm = peers.enter_context(vllm_up(args.vllm_python, hf, vllm_dtype, out / "vllm.log"))
            if 5 in only:
                report.append(f"5c. cold start, vLLM CPU: serving in {vllm.start_s:.1f} s")
        with_vllm = [vllm] if vllm is not None else []
        if only & {1, 5}:
            def disagg_up(log: str) -> Server:
                return splitserve_up(1, 1, out / log, kv=args.kv_cache_dtype, prompts=args.prefill_dtype,
                                     decodes=auto_decodes)

            first_s = None
            if 5 in only:
                # A machine's first start builds the CPU kernels and packs the
                # weights for them, once (README: "The first start packs ...");
                # the start timed below is a later one, as every start after
                # that is (on a new Zen 5 the first took 59.8 s: session 56).
                with disagg_up("up-first.log") as first:
                    first_s = first.start_s
            with disagg_up("up-disagg.log") as disagg:
                disagg_label = disagg.label
                if first_s is not None:
                    ok = disagg.start_s <= 10
                    report.append(f"5a. cold start, splitserve up --prefill 1 --decode 1: healthy and "
                                  f"serving in {disagg.start_s:.1f} s (target <= 10 s): {verdict(ok)}; "
                                  f"the start before it, which builds the CPU kernels and packs the "
                                  f"weights where this machine has not yet: {first_s:.1f} s")
                if 1 in only:
                    against(disagg, with_vllm, "mixed")
        llama: Server | None = None
        if args.llama_server and 2 in only:
            from engine.models.loader import gguf_source, resolve_model

            gguf = gguf_source(resolve_model(None))
            if gguf is None:
                report.append("2. llama.cpp: the default model has no GGUF source here; not measured")
            else:
                llama = peers.enter_context(llama_up(args.llama_server, gguf, out / "llama.log"))
        # float32 everywhere; bfloat16 too where it is native (dtype=auto picks one of them)
        report.append(f"0. dtype=auto serves {served_dtype('auto')} on this CPU")
        for dtype in ("float32", "bfloat16") if native else ("float32",):
            if not only & {1, 2, 3, 4}:
                break
            # --decode-dtype int8/bfloat16: a float32 model's option; the bfloat16 stack keeps its decodes
            decodes = args.decode_dtype if dtype == "float32" else "auto"
            with splitserve_up(0, 1, out / f"up-coloc-{dtype}.log", dtype, args.kv_cache_dtype,
                               args.prefill_dtype, decodes) as coloc:
                ours[coloc.label] = served_dtype(dtype)
                prompts_in[coloc.label] = ("bfloat16" if args.prefill_dtype == "bfloat16"
                                           else ours[coloc.label])
                decodes_in[coloc.label] = ("bfloat16" if decodes == "bfloat16-weights" else decodes
                                           if decodes in ("int8", "bfloat16") else ours[coloc.label])
                for t, w in ((1, "mixed"), (2, "single"), (3, "decode32"), (3, "batch32")):
                    if t == 1 and 1 in only:
                        against(coloc, with_vllm, w)
                    elif t == 2 and 2 in only:
                        against(coloc, with_vllm + ([llama] if llama is not None else []), w)
                    elif t == 3 and w == "decode32" and 3 in only:
                        decode_rounds[coloc.label] = r.bench_beside_peak(
                            coloc, w, DECODE_ROUNDS_QUICK if args.quick else DECODE_ROUNDS,
                            lambda: matmul_peak(threads))
                    elif t in only:
                        r.bench(coloc, w)
                if 4 in only:
                    # Held to the peak of its own minutes, as target 3's rounds are:
                    # the run's peak, measured minutes away, moved 800 to 1,965
                    # GFLOP/s within one run on the Intel Xeon with AMX (session 42).
                    before = matmul_peak(threads)
                    secs = prefill_seconds(coloc, PREFILL_TOKENS)
                    after = matmul_peak(threads)
                    flops = 2 * params * PREFILL_TOKENS + 2 * layers * PREFILL_TOKENS ** 2 * qdim
                    r.results[f"{coloc.label} / prefill"] = {"seconds": secs, "flops": flops / secs,
                                                            "peak": better_peaks(before, after)}
    done = r.results
    peak: dict[str, float] = {}
    if only & {3, 4}:
        peak_after = matmul_peak(threads)
        peak = better_peaks(peak_before, peak_after)
        report.append("0. matmul peak (512x576x3072, all cores; the better of before and after the servers): "
                      + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s (before {peak_before[k] / 1e9:.1f}, after "
                                  f"{peak_after.get(k, 0.0) / 1e9:.1f})" for k, v in peak.items()))
    if 4 in only:
        for label, dtype in prompts_in.items():
            pf = done[f"{label} / prefill"]
            name, best = dtype_peak(pf["peak"], dtype)
            rate = pf["flops"]
            report.append(f"4. prefill of {PREFILL_TOKENS} tokens, {label} ({dtype}): "
                          f"{pf['seconds']:.2f} s = {rate / 1e9:.1f} GFLOP/s = {rate / best:.0%} of "
                          f"the {name} peak measured right before and after it ({best / 1e9:.1f}; "
                          f"{rate / dtype_peak(peak, dtype)[1]:.0%} of the run's) (target >= 60%): "
                          f"{verdict(rate >= 0.6 * best)}")

    def tput(label: str, workload: str) -> float | None:
        key = f"{label} / {workload}"
        return done[key]["output_throughput"] if key in done else None

    vllm_label = f"vllm-cpu {vllm_dtype}"

    def peer_tput(label: str, peer: str, workload: str) -> float | None:
        """The peer's throughput measured beside `label`'s (alternating with it)."""
        got = beside.get(label, {}).get(f"{peer} / {workload}")
        return got["output_throughput"] if got else None

    def best_against_vllm(workload: str) -> tuple[str, float, float | None]:
        """Our colocated stack with the best ratio to the vLLM run beside it (the
        best throughput where vLLM was not measured) -> label, tok/s, vLLM's tok/s."""
        rows = [(k, v, peer_tput(k, vllm_label, workload)) for k in ours
                if (v := tput(k, workload)) is not None]
        assert rows
        return max(rows, key=lambda row: row[1] / row[2] if row[2] else row[1])

    if 1 in only:
        c_label, c, v = best_against_vllm("mixed")
        d, dv = tput(disagg_label, "mixed"), peer_tput(disagg_label, vllm_label, "mixed")
        assert d is not None
        line = f"1. mixed{' (each stack and vLLM A B B A)' if v else ''}: colocated {c:.1f} tok/s ({c_label})"
        line += (f" = {c / v:.2f}x {vllm_label} beside it ({v:.1f}) (target 1.5x): {verdict(c >= 1.5 * v)}"
                 if v else "")
        line += f"; disaggregated {d:.1f} tok/s"
        line += (f" = {d / dv:.2f}x {vllm_label} beside it ({dv:.1f}) (target 1.0x): {verdict(d >= dv)}"
                 if dv else "")
        if not v:
            line += ": vLLM not measured"
        report.append(line)
    if 2 in only:
        c2_label, c2, v2 = best_against_vllm("single")
        tpot = done[f"{c2_label} / single"]["tpot_ms"]["p50"]
        line = f"2. single stream (requests alternating): {c2_label} {c2:.1f} tok/s (TPOT p50 {tpot:.1f} ms)"
        line += (f"; {vllm_label} {v2:.1f} tok/s = {c2 / v2:.2f}x (target 1.5x): {verdict(c2 >= 1.5 * v2)}"
                 if v2 else "; vLLM not measured")
        l2 = beside.get(c2_label, {}).get("llama.cpp / single")
        if l2:
            lr, lt = l2["output_throughput"], l2["tpot_ms"]["p50"]
            line += (f"; llama.cpp {lr:.1f} tok/s (TPOT p50 {lt:.1f} ms) = {c2 / lr:.2f}x (target 1.0x): "
                     f"{verdict(c2 >= lr)}")
        else:
            line += "; llama.cpp not measured"
        report.append(line)
    if 3 in only:
        for label, dtype in decodes_in.items():
            name, best = dtype_peak(peak, dtype)
            rounds = decode_rounds[label]
            fractions = decode_fractions(rounds, dtype, params, layers, qdim)
            middle = statistics.median(fractions)
            each = "; ".join(
                f"{decode_rate(rd.summary, params, layers, qdim)[0]:.0f} tok/s (TPOT p50 "
                f"{rd.summary['tpot_ms']['p50']:.1f} ms) = {f:.0%} of {rd.peak(dtype)[1] / 1e9:.1f}"
                for rd, f in zip(rounds, fractions, strict=True))
            pure, arrivals = (done[f"{label} / {w}"] for w in ("decode32", "batch32"))
            rate32, flop_s, _ = decode_rate(pure, params, layers, qdim)
            report.append(f"3. batched decode at concurrency 32, {label} ({dtype}), {len(rounds)} rounds, "
                          f"each against the {name} peak measured right before and after it: {each}; median "
                          f"{middle:.0%} (target >= 50%): {verdict(middle >= 0.5)}; all rounds pooled "
                          f"{rate32:.0f} tok/s (TPOT p50 {pure['tpot_ms']['p50']:.1f} ms) = "
                          f"{flop_s / 1e9:.1f} GFLOP/s = {flop_s / best:.0%} of the run's {name} peak")
            rate32, flop_s, whole = decode_rate(arrivals, params, layers, qdim)
            report.append(f"3b. for reference, 64 requests keeping 32 in flight (the arrivals' prompts "
                          f"prefilled between the decodes), {label} ({dtype}): {rate32:.0f} tok/s (TPOT p50 "
                          f"{arrivals['tpot_ms']['p50']:.1f} ms) = {flop_s / best:.0%} of the {name} peak; "
                          f"the whole run, prompts included: {whole / 1e9:.1f} GFLOP/s = {whole / best:.0%}")
    if 5 in only:
        # Both at their best here: splitserve with this run's flags, Hugging
        # Face in float32 and, where bf16 is native, in bfloat16 too (its
        # faster dtype there, as vLLM's), held to the faster of the two; two
        # rounds, the second in reverse order (A B, B A), as the mixed workload.
        flags = ["--json", "--kv-cache-dtype", args.kv_cache_dtype, "--prefill-dtype", args.prefill_dtype,
                 "--decode-dtype", auto_decodes, "--hf-dtypes", "float32,bfloat16" if native else "float32",
                 "--rounds", "2"]
        if args.quick:
            flags += ["--num-prompts", "16"]
        cmd = [sys.executable, "-m", "services.cli", "bench", "offline", *flags]
        r.commands.append("splitserve bench offline " + " ".join(flags))
        print("\n== offline", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        print(proc.stdout, flush=True)
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        mine = rows["splitserve"]["output_tok_s"]
        hf_rates = {k: v["output_tok_s"] for k, v in rows.items() if k.startswith("hf-generate")}
        hf_best = max(hf_rates, key=hf_rates.__getitem__)
        hf_tps = hf_rates[hf_best]
        report.append(f"5b. offline (2 rounds, A B B A): splitserve {mine:.1f} tok/s, {hf_best} "
                      f"{hf_tps:.1f} tok/s "
                      f"(the fastest of {', '.join(f'{k} {v:.1f}' for k, v in hf_rates.items())}) "
                      f"= {mine / hf_tps:.2f}x (target 3x): {verdict(mine >= 3 * hf_tps)}")

    print("\n== commands")
    print("\n".join(r.commands))
    print(f"\n== targets on {cpu}")
    print("\n".join(sorted(report)))
    (out / "report.txt").write_text(f"CPU: {cpu}\n" + "\n".join(sorted(report)) + "\n")
    for path in r.plots():
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
