import subprocess
import sys

from engine.vocab.hashing import ROOT_HASH, extra_keys, hash_block, hash_blocks

EXTRA = extra_keys("m")


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(list(range(15)), 4, EXTRA)) == 3
    assert hash_blocks([1, 2, 3], 4, EXTRA) == []


def test_chain_depends_on_parent_tokens_and_extras() -> None:
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA)
    assert a[1] != b[1]  # same tokens in block 1, different parent
    assert a[0] == hash_block(None, [1, 2, 3, 4], EXTRA)
    assert a[1] == hash_block(a[0], [5, 6, 7, 8], EXTRA)
    assert hash_block(None, [1, 2, 3, 4], extra_keys("m", cache_salt="t1")) != a[0]
    assert hash_block(None, [1, 2, 3, 4], extra_keys("other")) != a[0]
    assert extra_keys("ab", "c") != extra_keys("a", "bc")
    assert len(ROOT_HASH) == 16


def test_resume_from_start_matches_full_chain() -> None:
    toks = list(range(40))
    full = hash_blocks(toks, 8, EXTRA)
    assert full[:2] + hash_blocks(toks, 8, EXTRA, parent=full[1], start=16) == full


def test_process_independent() -> None:
    code = ("from engine.vocab.hashing import hash_blocks, extra_keys;"
            "print(hash_blocks(list(range(32)), 16, extra_keys('m', 's'))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}, check=True).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1
    assert outs.pop().strip() == hash_blocks(list(range(32)), 16, extra_keys("m", "s"))[-1].hex()
