"""The model's tokenizer without transformers: the `tokenizers` library on tokenizer.json.

Importing transformers costs every process about a second of start-up (a
worker's start was a third of it).  What the engine and the frontend do with
text needs none of it: encode with the tokenizer's own special-token
post-processing (tokenizer.json holds the whole pipeline), decode, the
vocabulary and the EOS token.  transformers' tokenizer stays the reference
(tests/unit/test_text_tokenizer.py holds the two equal) and is loaded only
where it is needed: chat templates in `LLM.chat`, grammars (xgrammar).

`text_tokenizer_applies` says when this one is the model's tokenizer: a
tokenizer.json, and no setting in tokenizer_config.json that transformers
applies on top of it (space clean-up after decoding, BOS/EOS flags that
rebuild the post-processor).  Otherwise the engine loads transformers'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# tokenizer_config.json settings transformers applies over tokenizer.json's pipeline.
_APPLIED_ON_TOP = ("add_bos_token", "add_eos_token", "add_prefix_space")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def token_text(token: Any) -> str:
    return str(token["content"]) if isinstance(token, dict) else str(token)


def text_tokenizer_applies(model_dir: Path) -> bool:
    if not (model_dir / "tokenizer.json").exists():
        return False
    config = read_json(model_dir / "tokenizer_config.json")
    if config.get("clean_up_tokenization_spaces"):
        return False
    return not any(key in config for key in _APPLIED_ON_TOP)


class TextTokenizer:
    """encode / decode / get_vocab / eos_token_id, as transformers' fast
    tokenizer answers them for a model `text_tokenizer_applies` to."""

    def __init__(self, model_dir: Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"model: {model_dir} has no tokenizer.json")
        self._tok = _Backend.from_file(str(path))
        self.config = read_json(Path(model_dir) / "tokenizer_config.json")
        self.special_tokens = {k: token_text(self.config[k]) for k in SPECIAL_KEYS if self.config.get(k)}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call lets go of the GIL while it works (encode() holds it: a
        # 1 MiB prompt froze every other thread, the event loop's included, for
        # 1.5 s); the fast variant skips the character offsets nobody here reads.
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return list(encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))
