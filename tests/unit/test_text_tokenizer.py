"""The engine's transformers-free tokenizer (engine/vocab/tokenizer.py) answers
as transformers' own does, for the model it applies to, and a worker starts
without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.vocab.tokenizer import TextTokenizer, text_tokenizer_applies

TEXTS = ["Hello world", " leading space", "trailing space ", "emoji 🔥 and ünïcödé", "人工智能的发展",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n\treturn x  # tab",
         "", "   ", "a<|endoftext|>b", "numbers 1234567890 and 3.14159", "\n\n\nnewlines"]


def test_encode_decode_vocab_and_eos_equal_transformers(tokenizer, model_dir) -> None:  # type: ignore[no-untyped-def]
    assert text_tokenizer_applies(model_dir)
    text = TextTokenizer(model_dir)
    for t in TEXTS:
        for special in (True, False):
            ids = text.encode(t, add_special_tokens=special)
            assert ids == list(tokenizer.encode(t, add_special_tokens=special)), (t, special)
            for skip in (True, False):
                assert text.decode(ids, skip_special_tokens=skip) == \
                    tokenizer.decode(ids, skip_special_tokens=skip), (t, skip)
    # Partial UTF-8 sequences and single tokens decode alike too (the detokenizer's windows).
    ids = text.encode("🔥ü人", add_special_tokens=False)
    for i in range(len(ids)):
        assert text.decode(ids[:i + 1]) == tokenizer.decode(ids[:i + 1])
        assert text.decode([ids[i]]) == tokenizer.decode([ids[i]])
    assert text.get_vocab() == tokenizer.get_vocab()
    assert text.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("setting", [{"clean_up_tokenization_spaces": True}, {"add_bos_token": True},
                                     {"add_eos_token": False}])
def test_settings_transformers_applies_on_top_keep_its_tokenizer(tmp_path: Path, model_dir,  # type: ignore[no-untyped-def]
                                                                 setting) -> None:
    from engine.models.loader import load_text_tokenizer

    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **setting}))
    assert not text_tokenizer_applies(tmp_path)
    assert not isinstance(load_text_tokenizer(tmp_path), TextTokenizer)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert isinstance(load_text_tokenizer(tmp_path), TextTokenizer)


def test_an_engine_runs_without_importing_transformers(model_dir) -> None:  # type: ignore[no-untyped-def]
    """Generate text in a fresh process: transformers stays unimported until
    something asks for its tokenizer (here: `LLM.tokenizer`)."""
    code = (
        "import sys\n"
        "from engine import LLM, SamplingParams\n"
        "llm = LLM(dtype='float32', num_blocks=16, max_num_seqs=1, num_threads=1, max_model_len=256)\n"
        "out = llm.generate('The capital of France is', SamplingParams(temperature=0, max_tokens=4))\n"
        "assert out[0].outputs[0].text, out\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "assert llm.tokenizer.decode(out[0].outputs[0].token_ids) == out[0].outputs[0].text\n"
        "assert 'transformers' in sys.modules\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
