"""Single-stream decode speed per weight format on SmolLM2-135M (CPU, float32
activations), every format made here from the default model's weights.

    python -m benchmarks.weight_formats [--new-tokens 128] [--repeats 3]

Formats: float32 panels (the default model with its 4-bit copy dropped), the
default GGUF (Q4_1), GGUF files re-quantized to Q4_0, Q8_0, and K-quant files,
and AWQ / GPTQ checkpoints made with the reference packers of tests/quant_ref.py.
SmolLM2's 576-wide rows are not whole 256-input super-blocks, so, as llama.cpp
does with such rows, the K-quant files hold Q4_K / Q6_K in ffn_down only (1536
inputs) and Q4_0 / Q8_0 in the rest; AWQ/GPTQ use groups of 64 (576 = 9 x 64).
Prints the CPU (lscpu) and, per format, decode tok/s of one stream, prefill
tok/s, the packed weights the engine holds, and how its layers run.  THREADS
(environment, default 1: on a shared 2-core machine two threads wait on each
other's preemption) sets the engine's threads.  All formats are loaded first and
measured in rounds, one run of each per round; the medians are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def cpu_summary() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda k: info.get(k, "?").strip()  # noqa: E731
    wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    flags = [f for f in wanted if f in get("Flags").split()]
    return (f"{get('Model name')} (family {get('CPU family')} model {get('Model')}), "
            f"{get('CPU(s)')} CPUs; flags: {' '.join(flags)}")


def requantized_gguf(src: Path, dst: Path, plan: dict[str, str]) -> None:
    """`src` with its projections re-quantized: plan maps a GGUF tensor-name
    part (attn_q, ffn_down, ...) to a type; "*" for the rest of them."""
    import gguf

    from tests.quant_ref import quantize

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        dense = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if part not in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            writer.add_tensor(t.name, dense)
            continue
        qtype = plan.get(part, plan["*"])
        raw, _ = quantize(dense.reshape(int(t.shape[1]), int(t.shape[0])), qtype)
        writer.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def int4_checkpoint(float_dir: Path, dst: Path, method: str, group: int) -> None:
    """An AWQ or GPTQ (original format) checkpoint of float_dir's projections."""
    from safetensors.torch import load_file, save_file

    from tests.quant_ref import pack_awq, pack_gptq, quantize_groups

    tensors = load_file(str(float_dir / "model.safetensors"))
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            gq = quantize_groups(t, group, min_zero=1)
            parts = pack_awq(gq) if method == "awq" else pack_gptq(gq, v1=True)
            out.update({f"{name[:-len('.weight')]}.{s}": v for s, v in parts.items()})
        else:
            out[name] = t.contiguous()
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((float_dir / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_method=method, bits=4, group_size=group, desc_act=False,
                                      version="gemm", zero_point=True, sym=False)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in float_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(f, dst / f.name)


PREFILL_TOKENS = 256


def describe(model: Any) -> tuple[int, str]:
    """(bytes of packed weights, how the projections run)."""
    layers = [model.get_submodule(p) for p in model.linear_names()]
    held = [t for layer in layers for t in (layer.panels, layer.q4) if t is not None]
    size = sum(t.numel() * t.element_size() for t in held)
    four = sum(layer.q4 is not None for layer in layers)
    only = sum(layer.q4 is not None and layer.panels is None for layer in layers)
    return size, f"{four}/{len(layers)} layers 4-bit ({only} with no float copy)"


def load(model: str | None, drop_int4: bool = False) -> Any:
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", num_blocks=64, num_threads=int(os.environ.get("THREADS", "1")))
    if drop_int4:
        net = llm.engine.runner.model
        for p in net.linear_names():
            setattr(net.get_submodule(p), "q4", None)  # noqa: B010 - the float panels alone
    llm.generate(list(range(1000, 1016)), SamplingParams(temperature=0, max_tokens=4))  # warm-up
    return llm


def one_round(llm: Any, new_tokens: int, round_no: int) -> tuple[float, float]:
    """-> (decode tok/s of one stream, prefill tok/s of a PREFILL_TOKENS prompt)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(list(range(1000, 1032)), params)
    decode = len(out[0].outputs[0].token_ids) / (time.perf_counter() - t)
    t = time.perf_counter()  # a new prompt each round: no prefix-cache hit
    prompt = [round_no + 1, *range(1000, 1000 + PREFILL_TOKENS)]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    return decode, PREFILL_TOKENS / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_formats",
                                description=(__doc__ or "").split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated per run")
    p.add_argument("--repeats", type=int, default=5, help="rounds (one run per format each; medians printed)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    from engine.layers.cpu_attention import load_cpu_kernel, load_linear_kernel
    from engine.models.loader import resolve_model
    from engine.vocab.models import default_gguf

    print(cpu_summary())
    print(f"| format | decode tok/s (1 stream) | prefill tok/s ({PREFILL_TOKENS}-token prompt) "
          "| packed weights MiB | layers |\n|---|---:|---:|---:|---|")
    float_dir, src = resolve_model(None), default_gguf()
    assert load_linear_kernel() is not None and load_cpu_kernel() is not None  # built under the real cache
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ["SPLITSERVE_CACHE"] = str(tmp / "cache")  # conversions and packings stay here
        formats: dict[str, tuple[str | None, bool]] = {
            "float32 panels": (None, True), "GGUF Q4_1 (default)": (None, False)}
        for label, plan in (("GGUF Q4_0", {"*": "Q4_0"}), ("GGUF Q8_0", {"*": "Q8_0"}),
                            ("GGUF Q4_K (ffn_down) + Q4_0", {"ffn_down": "Q4_K", "*": "Q4_0"}),
                            ("GGUF Q6_K (ffn_down) + Q8_0", {"ffn_down": "Q6_K", "*": "Q8_0"})):
            path = tmp / f"{label.split()[1]}.gguf"
            requantized_gguf(src, path, plan)
            formats[label] = (str(path), False)
        for method in ("awq", "gptq"):
            int4_checkpoint(float_dir, tmp / method, method, 64)
            formats[f"{method.upper()} int4 g64"] = (str(tmp / method), False)
        llms = {label: load(model, drop) for label, (model, drop) in formats.items()}
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label in llms}
        for r in range(args.repeats):  # rounds over all formats: a shared machine's load hits each alike
            for label, llm in llms.items():
                runs[label].append(one_round(llm, args.new_tokens, r))
        results = {}
        for label, llm in llms.items():
            size, how = describe(llm.engine.runner.model)
            decode, prefill = (statistics.median(x) for x in zip(*runs[label], strict=True))
            results[label] = {"decode_tok_s": decode, "prefill_tok_s": prefill, "runs": runs[label],
                              "weights_mb": size / 2**20, "layers": how}
            print(f"| {label} | {decode:.1f} | {prefill:.0f} | {size / 2**20:.0f} | {how} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_summary(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
