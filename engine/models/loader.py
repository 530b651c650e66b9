"""Find a model on disk and turn it into a Hugging Face directory.

A model is a Hugging Face directory (config.json + safetensors + tokenizer) or a
GGUF file. GGUF files are converted once, through transformers' GGUF reader,
into a directory of float32 safetensors under the cache dir, so later starts
load in about a second. Nothing is downloaded from a hub.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from engine.vocab.models import cache_dir, converted_dir, is_converted, model_name, model_source

__all__ = ["cache_dir", "gguf_source", "load_text_tokenizer", "load_tokenizer", "model_name", "resolve_model"]

log = logging.getLogger(__name__)

GGUF_SOURCE = "gguf_source.json"  # in a converted directory: which file it came from


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Return a Hugging Face model directory for `model` (None: the default)."""
    path = model_source(model)
    if path.is_dir():
        return path
    out = _convert_gguf(path)
    marker = out / GGUF_SOURCE
    if not marker.exists():  # conversions made before the marker lacked it
        tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"gguf": str(path.resolve())}))
        os.replace(tmp, marker)
    return out


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file `model_dir` was converted from (its 4-bit tensors are
    packed from the file's own blocks), or None."""
    marker = Path(model_dir) / GGUF_SOURCE
    if not marker.exists():
        return None
    path = Path(json.loads(marker.read_text())["gguf"])
    return path if path.is_file() else None


def _convert_gguf(gguf: Path) -> Path:
    out = converted_dir(gguf)
    if is_converted(out):
        return out
    log.info("converting %s to safetensors under %s (once)", gguf, out)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "float32"
    state = {k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(tmp)
    if hf.generation_config is not None:
        hf.generation_config.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process converted it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_text_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    """What the engine encodes, decodes and reads the vocabulary with: the
    transformers-free tokenizer (engine/vocab/tokenizer.py) where it is the
    model's own, else transformers'."""
    from engine.vocab.tokenizer import TextTokenizer, text_tokenizer_applies

    if text_tokenizer_applies(Path(model_dir)):
        return TextTokenizer(Path(model_dir))
    return load_tokenizer(model_dir)


def load_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    """The model's tokenizer.  A tokenizer.json holds the whole pipeline, so it
    loads as a plain fast tokenizer: AutoTokenizer would first import the
    model's config class and its dependencies, 3 s of every worker's start."""
    if (Path(model_dir) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


if __name__ == "__main__":
    # `python -m engine.models.loader [MODEL]`: convert once, print the directory.
    # The frontend runs this in a child process, so that it never imports torch.
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))
