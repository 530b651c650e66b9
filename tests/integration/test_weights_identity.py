"""New weights under the same model name (a rollout that overwrites the files):
the engines' model ids differ, so their KV layouts refuse each other (at the
prefill's check and at the UCX handshake) and no block hash is shared."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from kvtransfer.layout import LayoutMismatch, check_compatible
from services.kv_layout import handoff_from_proto, handoff_to_proto


def nudged_copy(model_dir: Path, root: Path, tensor: str, factor: float) -> Path:
    """root/<name>: the model's files, but the weight whose name ends in
    `tensor` scaled by `factor` (a fine-tune deployed under the same name)."""
    from safetensors.torch import load_file, save_file

    new = root / model_dir.name
    new.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (new / f.name).symlink_to(f)
    state = load_file(str(model_dir / "model.safetensors"))
    name = next(k for k in state if k.endswith(tensor))
    state[name] = state[name] * factor
    save_file(state, str(new / "model.safetensors"), metadata={"format": "pt"})
    return new


@pytest.fixture(scope="module")
def two_versions(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """old/<name>: the model as it is; new/<name>: one weight nudged."""
    root = tmp_path_factory.mktemp("versions")
    old = root / "old" / model_dir.name
    old.parent.mkdir()
    old.symlink_to(model_dir, target_is_directory=True)
    return old, nudged_copy(model_dir, root / "new", "layers.0.self_attn.k_proj.weight", 1.001)


def test_new_weights_under_the_same_name_never_mix(two_versions: tuple[Path, Path]) -> None:
    old, new = (LLM(model=str(p), dtype="float32", num_blocks=16, num_threads=1).engine for p in two_versions)
    assert old.model_name == new.model_name
    assert old.model_id != new.model_id
    print(f"\nsame name, two weight versions: {old.model_id} vs {new.model_id}")
    # The prefill's check of the decode's handoff (as the Prefill RPC carries it) names the field.
    handoff = new.reserve_remote("h", new.tokenize("a prompt"), SamplingParams(max_tokens=1))
    assert handoff is not None and handoff.layout == new.kv_layout
    with pytest.raises(LayoutMismatch) as info:
        handoff_from_proto(handoff_to_proto(handoff)).check_layout(old.kv_layout)
    assert "model_id: local" in str(info.value) and "kv_cache_dtype" not in str(info.value)
    new.abort("h")
    # The UCX handshake refuses too.
    with pytest.raises(LayoutMismatch, match="model_id"):
        check_compatible(old.kv_layout, new.kv_layout)
    # Same prompt, no shared block hash (prefix index, prefix cache).
    ids = old.tokenize("The same prompt on two versions of the weights, long enough for blocks. " * 3)
    old_hashes, new_hashes = (set(eng.add_request("r", ids, SamplingParams(max_tokens=1))
                                  .update_block_hashes(eng.kv.block_size)) for eng in (old, new))
    assert len(old_hashes) == len(new_hashes) == len(ids) // old.kv.block_size > 0
    assert not old_hashes & new_hashes
