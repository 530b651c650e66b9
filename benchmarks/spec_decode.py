"""Speculative decoding: output tokens/s with each method against none, on a
free-chat workload and a repetitive one ("rewrite this text"), single stream
and batch 8, in one run; plus each method's mean accepted length and
acceptance rate.

    python -m benchmarks.spec_decode                  # all methods, a few minutes on 2 CPU cores
    python -m benchmarks.spec_decode --methods none,ngram --max-tokens 48

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


def run(llm: Any, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    """-> (output tok/s, tokens); batch 1 runs the prompts one after another."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs: list[list[int]] = []
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], params)]
    dt = time.perf_counter() - t
    return sum(len(o) for o in outs) / dt, outs


def bench_method(name: str, cfg: dict[str, Any] | None, args: argparse.Namespace,
                 prompts: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    from engine import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, num_threads=args.num_threads, max_model_len=1024, num_blocks=512,
              enable_prefix_caching=False, speculative_config=cfg)
    llm.generate("warm up", SamplingParams(temperature=0, max_tokens=4))
    rows = []
    for workload, ps in prompts.items():
        for batch, subset in ((1, ps[:args.num_single]), (8, ps[:8])):
            spec = llm.engine.spec
            before = (spec.stats.num_drafts, spec.stats.num_draft_tokens,
                      spec.stats.num_accepted_tokens) if spec else (0, 0, 0)
            tok_s, outs = run(llm, subset, args.max_tokens, batch)
            drafts, draft_toks, accepted = (
                (spec.stats.num_drafts - before[0], spec.stats.num_draft_tokens - before[1],
                 spec.stats.num_accepted_tokens - before[2]) if spec else (0, 0, 0))
            rows.append({"method": name, "workload": workload, "batch": batch, "tok_s": tok_s,
                         "mean_accepted_len": 1 + accepted / drafts if drafts else None,
                         "acceptance_rate": accepted / draft_toks if draft_toks else None,
                         "drafts": drafts, "tokens": outs})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    base = {(r["workload"], r["batch"]): r for r in rows if r["method"] == "none"}
    print("| workload | batch | method | output tok/s | vs none | mean accepted length | acceptance rate |"
          " same tokens |")
    print("|---|---:|---|---:|---:|---:|---:|:---:|")
    for r in sorted(rows, key=lambda r: (r["workload"], r["batch"])):
        b = base.get((r["workload"], r["batch"]))
        speedup = f"{r['tok_s'] / b['tok_s']:.2f}x" if b else "-"
        same = "yes" if b and b["tokens"] == r["tokens"] else ("-" if not b else "NO")
        mal = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] else "-"
        rate = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        print(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']:.1f} | {speedup} | {mal} | "
              f"{rate} | {same} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode")
    p.add_argument("--methods", default="none,ngram,layerskip,draft")
    p.add_argument("--workloads", default="chat,rewrite")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-single", type=int, default=3, help="prompts run one at a time (single stream)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--layerskip-layers", type=int, default=12)
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=None)
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
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = export_draft(model_dir, Path(tmp) / "draft", args.draft_layers) if "draft" in methods else None
        configs = spec_configs(args, draft_dir)
        for m in methods:
            rows += bench_method(m, configs[m], args, prompts)
            print(f"[{m} done]", flush=True)
    print_table(rows)
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
