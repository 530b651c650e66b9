"""Where a decode step's milliseconds go: one offline engine per dtype, in one
process, decoding `--batch` sequences; each step's wall time split into
scheduling, model forward (projections, attention, the rest), the head,
sampling and detokenization.  Variants are interleaved step by step (A/B/A/B)
and medians reported, since the machines are shared and noisy.

    python -m benchmarks.step_profile --dtypes float32,bfloat16 --batch 1 --steps 64
    python -m benchmarks.step_profile --dtypes float32,float32/bfloat16 --batch 32   # dtype/KV cache dtype
    python -m benchmarks.step_profile --dtypes float32/bfloat16,float32/bfloat16+bfloat16  # --decode-dtype

A decode step runs every layer in one kernel call (the decode stack,
engine/models/decode_stack.py), timed whole as "forward"; --layer-parts
times the projections and attention inside it instead, on the Python layer
loop (the path of steps with prompt tokens), whose calls cost more.

An AVX2-only machine's step on a CPU with AVX-512 (its linear kernels and
its attention build): SPLITSERVE_LINEAR_ISA=avx2 SPLITSERVE_ATTENTION_ISA=avx2
python -m benchmarks.step_profile --dtypes float32/float16 --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# engine before torch: it picks how OpenMP's idle threads wait, and with that
# the kernels' thread pool, as a worker does (engine/__init__.py).
from engine import LLM, SamplingParams
from engine.layers.cpu_features import cpu_summary
from services.help_format import DefaultsHelpFormatter as HelpFormatter


class Clock:
    """Accumulates time per named part for the current step: wall time, or
    this thread's CPU time (with one torch thread, all of the step's work runs
    on it; on a loaded machine CPU time is what stays comparable)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.parts: dict[str, float] = defaultdict(float)
        self.now = now
        self.open: set[str] = set()  # parts being timed now

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        # A part inside itself (forward_normed calling forward on the float32
        # path) is timed once, by the outermost call.
        if name in self.open:
            yield
            return
        self.open.add(name)
        t0 = self.now()
        try:
            yield
        finally:
            self.parts[name] += self.now() - t0
            self.open.discard(name)

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return fn(*args, **kwargs)
        setattr(obj, attr, timed)


def instrument(llm: LLM, clock: Clock, layer_parts: bool) -> None:
    """Time the engine's parts by wrapping them (nested parts subtract later);
    layer_parts: the projections and attention too, on the Python layer loop."""
    eng = llm.engine
    runner = eng.runner
    model = runner.model
    clock.wrap(eng.scheduler, "schedule", "schedule")
    clock.wrap(eng.scheduler, "update", "update")
    clock.wrap(runner, "prepare", "prepare")
    clock.wrap(model, "forward", "forward")
    clock.wrap(model, "compute_logits", "head")
    clock.wrap(model, "compute_argmax", "head")  # greedy rows on a head that fuses it: no sample
    clock.wrap(eng, "_output", "detokenize")
    import engine.model_runner as mr
    clock.wrap(mr, "sample", "sample")
    if not layer_parts:
        return
    attn = runner.attn  # wrapped below: not the CPU kernel's paged_attention, so no decode stack

    def timed_attn(*args: Any, **kwargs: Any) -> Any:
        with clock.part("attention"):
            return attn(*args, **kwargs)
    runner.attn = timed_attn  # type: ignore[assignment]
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            mod = getattr(layer, name)
            # all but the first: packed layers
            for method in ("forward", "forward_normed", "forward_normed_silu", "forward_silu"):
                if hasattr(mod, method):
                    clock.wrap(mod, method, "projections")


def run(dtypes: list[str], batch: int, prompt_len: int, steps: int, threads: int, cpu_time: bool,
        layer_parts: bool) -> None:
    import torch

    now = time.thread_time if cpu_time else time.perf_counter
    llms: dict[str, tuple[LLM, Clock]] = {}
    for dt in dtypes:
        # "float32/bfloat16": a float32 model, a bfloat16 cache; "+int8": --decode-dtype int8 (or bfloat16)
        # "...:logits": greedy rows sampled from the logits where the head would fuse their argmax
        spec, _, head = dt.partition(":")
        base, _, decode = spec.partition("+")
        model_dtype, _, kv = base.partition("/")
        llm = LLM(dtype=model_dtype, num_threads=threads, max_num_seqs=max(batch, 1),
                  kv_cache_dtype=kv or "auto", decode_dtype=decode or "auto")
        llm.engine.runner.fused_argmax = head != "logits"
        clock = Clock(now)
        instrument(llm, clock, layer_parts)
        llms[dt] = (llm, clock)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    for dt, (llm, _) in llms.items():
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"{dt}-{i}", p, params)
        while llm.engine.scheduler.num_waiting or any(
                r.num_output_tokens < 1 for r in llm.engine.scheduler.running):  # prefill first
            llm.engine.step()
    samples: dict[str, dict[str, list[float]]] = {dt: defaultdict(list) for dt in dtypes}
    for _ in range(steps):
        for dt, (llm, clock) in llms.items():  # interleaved: A B A B ...
            clock.parts.clear()
            t0 = now()
            llm.engine.step()
            total = now() - t0
            parts = dict(clock.parts)
            parts["total"] = total
            for k, v in parts.items():
                samples[dt][k].append(v * 1e3)
    print(f"# {cpu_summary()}; torch {torch.__version__}, {threads} threads; batch {batch}, "
          f"context ~{prompt_len}, {steps} decode steps; medians in ms of "
          f"{'CPU time of the one engine thread' if cpu_time else 'wall time'} (variants interleaved)")
    order = ["total", "schedule", "prepare", "forward", "projections", "attention", "head", "sample",
             "update", "detokenize"]
    print("| part | " + " | ".join(dtypes) + " |")
    print("|---|" + "---:|" * len(dtypes))
    for part in order:
        vals = []
        for dt in dtypes:
            got = samples[dt].get(part)
            vals.append(f"{statistics.median(got):.2f}" if got else "-")
        print(f"| {part} | " + " | ".join(vals) + " |")
    for dt in dtypes:
        med = {k: statistics.median(v) for k, v in samples[dt].items()}
        other = med["forward"] - med.get("projections", 0) - med.get("attention", 0)
        rest = med["total"] - sum(med.get(k, 0) for k in ("schedule", "prepare", "forward", "head", "sample",
                                                          "update", "detokenize"))
        if not layer_parts:
            print(f"{dt}: step unaccounted (engine python) {rest:.2f} ms; {1e3 / med['total']:.1f} steps/s "
                  "(the layers in one call: --layer-parts splits them, on the Python loop)")
            continue
        print(f"{dt}: forward other (norms, rope, embed, python) {other:.2f} ms; "
              f"step unaccounted (engine python) {rest:.2f} ms; {1e3 / med['total']:.1f} steps/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated dtypes to compare; DTYPE/KV sets the KV cache dtype too, "
                         "+int8 --decode-dtype int8, :logits samples greedy rows from the logits where the "
                         "head would take their argmax itself")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per dtype")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the thread's CPU time, not wall time (needs --threads 1)")
    ap.add_argument("--layer-parts", action="store_true",
                    help="time the projections and attention inside the forward (on the Python layer loop, "
                         "not the decode stack)")
    a = ap.parse_args()
    if a.cpu_time and a.threads != 1:
        ap.error("--cpu-time: needs --threads 1 (other threads' work would not be counted)")
    run(a.dtypes.split(","), a.batch, a.prompt_len, a.steps, a.threads, a.cpu_time, a.layer_parts)


if __name__ == "__main__":
    main()
