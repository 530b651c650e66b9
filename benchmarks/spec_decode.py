"""Speculative decoding: output tokens/s with each method against none, on a
free-chat workload and a repetitive one ("rewrite this text"), single stream
and batch 8, in one run; plus each method's mean accepted length and
acceptance rate.

    python -m benchmarks.spec_decode --max-tokens 48 --num-single 2   # all methods, ~15 min on 2 CPU cores
    python -m benchmarks.spec_decode --methods none,ngram --workloads rewrite --repeats 1   # ~2 min

Greedy, so every method emits the same tokens as none (the tests check it)
and the comparison is of time alone.  draft: the target's first layers
exported as a separate model directory (SmolLM2-135M is already the smallest
of its family; there is no smaller model with its tokenizer on this machine).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

CHAT = [
    "Why is the sky blue?",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short poem about the ocean.",
    "What are the benefits of regular exercise?",
    "How do I make a good cup of tea?",
    "What should I pack for a weekend hiking trip?",
    "Tell me a fun fact about octopuses.",
]
TEXTS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up "
    "to five books at a time, and each loan lasts three weeks. Late returns cost ten cents per day.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. When the "
    "light turns green, connect to the network named HomeNet with the password printed on the label.",
    "Our team meeting moved from Tuesday to Thursday at two o'clock. Please bring the quarterly report, "
    "the budget draft, and your list of open questions about the new project schedule.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / "
    "len(values)\n\ndef variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in "
    "values) / len(values)\n",
    "Preheat the oven to 180 degrees. Mix the flour, sugar and butter in a large bowl, add two eggs, and "
    "stir until smooth. Pour the batter into a greased tin and bake for forty minutes.",
    "The museum's east wing holds paintings from the sixteenth century, while the west wing shows modern "
    "sculpture. Guided tours start every hour from the main hall and last about forty-five minutes.",
    "Dear Anna, thank you for your letter and the photos from your trip. The mountains look beautiful, "
    "and I am glad the weather was kind to you. Let us meet for coffee when you are back. Best, Tom",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature, and food takes longer to cook.",
]
WORKLOADS = {
    "chat": CHAT,
    "rewrite": [f"Rewrite the following text exactly, word for word:\n\n{t}" for t in TEXTS],
}


def spec_configs(args: argparse.Namespace, draft_dir: Path | None) -> dict[str, dict[str, Any] | None]:
    k = args.num_speculative_tokens
    return {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
        "layerskip": {"method": "layerskip", "num_speculative_tokens": k,
                      "num_layers": args.layerskip_layers},
        "draft": {"method": "draft", "num_speculative_tokens": k, "model": str(draft_dir)},
    }


def export_draft(target: Path, out: Path, num_layers: int) -> Path:
    """The target's first num_layers layers, final norm and head, with its tokenizer."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    tensors = {}
    with safe_open(str(target / "model.safetensors"), framework="pt") as st:
        for name in st.keys():  # noqa: SIM118
            parts = name.split(".")
            if not (len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= num_layers):
                tensors[name] = st.get_tensor(name)
    cfg["num_hidden_layers"] = num_layers
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / f).exists():
            shutil.copy(target / f, out / f)
    return out


def run(llm: Any, prompts: list[list[int]], max_tokens: int,
        batch: int) -> tuple[float, float, list[list[int]]]:
    """-> (output tokens per wall second, per CPU second of this process,
    tokens); batch 1 runs the prompts one after another.  With one torch
    thread, CPU time is what the run costs with the machine to itself; on a
    shared machine it is far less noisy than wall time."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs: list[list[int]] = []
    t, c = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], params)]
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    n = sum(len(o) for o in outs)
    return n / wall, n / cpu, outs


def make_llm(cfg: dict[str, Any] | None, args: argparse.Namespace) -> Any:
    from engine import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, num_threads=args.num_threads, max_model_len=1024, num_blocks=512,
              enable_prefix_caching=False, speculative_config=cfg)
    llm.generate("warm up", SamplingParams(temperature=0, max_tokens=4))
    return llm


def spec_counts(llm: Any) -> tuple[int, int, int]:
    s = llm.engine.spec.stats if llm.engine.spec is not None else None
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) if s else (0, 0, 0)


def bench(llms: dict[str, Any], prompts: dict[str, list[list[int]]],
          args: argparse.Namespace) -> list[dict[str, Any]]:
    """Methods take turns on each workload and batch size, best of --repeats
    each, so load from other jobs on a shared machine hits them alike."""
    rows = []
    for workload, ps in prompts.items():
        for batch, subset in ((1, ps[:args.num_single]), (8, ps[:8])):
            best: dict[str, float] = {}
            best_cpu: dict[str, float] = {}
            tokens: dict[str, list[list[int]]] = {}
            counts = {m: spec_counts(llm) for m, llm in llms.items()}
            for _ in range(args.repeats):
                for m, llm in llms.items():
                    tok_s, tok_cpu_s, tokens[m] = run(llm, subset, args.max_tokens, batch)
                    best[m] = max(best.get(m, 0.0), tok_s)
                    best_cpu[m] = max(best_cpu.get(m, 0.0), tok_cpu_s)
            for m, llm in llms.items():
                now, then = spec_counts(llm), counts[m]
                drafts, draft_toks, accepted = (a - b for a, b in zip(now, then, strict=True))
                rows.append({"method": m, "workload": workload, "batch": batch, "tok_s": best[m],
                             "tok_cpu_s": best_cpu[m],
                             "mean_accepted_len": 1 + accepted / drafts if drafts else None,
                             "acceptance_rate": accepted / draft_toks if draft_toks else None,
                             "drafts": drafts, "tokens": tokens[m]})
            print(f"[{workload} batch {batch} done]", flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    base = {(r["workload"], r["batch"]): r for r in rows if r["method"] == "none"}
    print("| workload | batch | method | tok/s (wall) | vs none | tok/s (CPU time) | vs none |"
          " mean accepted length | acceptance rate | same tokens |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|:---:|")
    for r in sorted(rows, key=lambda r: (r["workload"], r["batch"])):
        b = base.get((r["workload"], r["batch"]))
        speedup = f"{r['tok_s'] / b['tok_s']:.2f}x" if b else "-"
        speedup_cpu = f"{r['tok_cpu_s'] / b['tok_cpu_s']:.2f}x" if b else "-"
        same = "yes" if b and b["tokens"] == r["tokens"] else ("-" if not b else "NO")
        mal = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] else "-"
        rate = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        print(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']:.1f} | {speedup} | "
              f"{r['tok_cpu_s']:.1f} | {speedup_cpu} | {mal} | {rate} | {same} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode")
    p.add_argument("--methods", default="none,ngram,layerskip,draft")
    p.add_argument("--workloads", default="chat,rewrite")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-single", type=int, default=3, help="prompts run one at a time (single stream)")
    p.add_argument("--repeats", type=int, default=2, help="runs per method and case; the best counts")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--layerskip-layers", type=int, default=12)
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (1: CPU time = cost)")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    args = p.parse_args(argv)

    from engine.models.loader import load_tokenizer, resolve_model

    model_dir = resolve_model(None)
    tok = load_tokenizer(model_dir)
    prompts = {}
    for w in args.workloads.split(","):
        prompts[w] = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=True) for c in WORKLOADS[w]]
        prompts[w] = [list(x["input_ids"] if not isinstance(x, list) else x) for x in prompts[w]]
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = None
        if "draft" in methods:
            draft_dir = export_draft(model_dir, Path(tmp) / "draft", args.draft_layers)
        configs = spec_configs(args, draft_dir)
        llms = {m: make_llm(configs[m], args) for m in methods}
    rows = bench(llms, prompts, args)
    print_table(rows)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
