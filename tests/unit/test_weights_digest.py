"""model_id = name + a digest of the weights' bytes: new weights under the same
file name are another model; the digest is kept, so later starts only stat."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from engine.vocab import models as loader
from engine.vocab.hashing import cache_model_key, extra_keys, hash_blocks


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model_dir(root: Path, weights: bytes) -> Path:
    d = root / "TinyModel"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"num_hidden_layers": 2}')
    (d / "model.safetensors").write_bytes(weights)
    (d / "tokenizer.json").write_text("{}")  # not weights: not in the digest
    return d


def test_same_name_other_weights_is_another_model(tmp_path: Path) -> None:
    a = _model_dir(tmp_path / "a", b"\x01" * 4096)
    b = _model_dir(tmp_path / "b", b"\x01" * 4095 + b"\x02")  # one byte differs
    c = _model_dir(tmp_path / "c", b"\x01" * 4096)  # a's bytes elsewhere
    assert loader.model_name(a) == loader.model_name(b) == "TinyModel"
    assert loader.model_id(a) != loader.model_id(b)
    assert loader.model_id(a) == loader.model_id(c)
    assert loader.model_id(a).startswith("TinyModel-") and len(loader.model_id(a)) == len("TinyModel-") + 12
    # ...so their blocks never share a hash.
    ids = list(range(64))
    ha, hb = (hash_blocks(ids, 16, extra_keys(cache_model_key(loader.model_id(d), "bfloat16", "bfloat16")))
              for d in (a, b))
    assert not set(ha) & set(hb)


def test_dtypes_are_in_the_block_hash() -> None:
    keys = {cache_model_key("m-0123456789ab", d, kv) for d, kv in
            [("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn"),
             ("float32", "float8_e4m3fn"), ("bfloat16", "float8_e5m2")]}
    hashes = {hash_blocks(list(range(16)), 16, extra_keys(k))[0] for k in keys}
    assert len(hashes) == 5


def test_config_change_is_another_model(tmp_path: Path) -> None:
    a = _model_dir(tmp_path / "a", b"w" * 100)
    before = loader.model_id(a)
    (a / "config.json").write_text('{"num_hidden_layers": 3}')
    assert loader.model_id(a) != before


def test_gguf_digest_is_kept_and_redone_when_the_file_changes(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "Tiny.Q4_1.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 1000)
    first = loader.model_id(f)
    assert first.startswith("Tiny.Q4_1-")

    def no_hashing(*_: object) -> None:
        raise AssertionError("hashed again though the file did not change")

    monkeypatch.setattr(hashlib, "file_digest", no_hashing)
    assert loader.model_id(f) == first  # kept: a stat, no read
    monkeypatch.undo()
    f.write_bytes(b"GGUF" + b"\x00" * 999 + b"\x01")  # new weights, same name
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 1))
    assert loader.model_id(f) != first


def test_default_model_digest_is_fast_cold_and_warm() -> None:
    """The default GGUF hashed from cold (an empty cache dir) well inside the
    10 s cold-start budget, then read back from the cache."""
    t0 = time.monotonic()
    cold = loader.model_id(None)
    cold_s = time.monotonic() - t0
    t0 = time.monotonic()
    assert loader.model_id(None) == cold
    warm_s = time.monotonic() - t0
    size = loader.default_gguf().stat().st_size
    print(f"\nweights digest of {size / 2**20:.0f} MiB: cold {cold_s:.2f} s, "
          f"warm {warm_s * 1000:.1f} ms -> {cold}")
    assert cold.startswith(loader.DEFAULT_MODEL_NAME + "-")
    assert cold_s < 5.0 and warm_s < 0.5
