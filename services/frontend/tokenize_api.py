"""vLLM's /tokenize and /detokenize, in vLLM's shapes.

    POST /tokenize    {"prompt": str, "add_special_tokens": true}
                      or {"messages": [...], "add_generation_prompt": true}  (the chat template applied)
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": str}
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from services.frontend.errors import bad_request, from_value_error
from services.frontend.prepare import Preparer, chat_messages
from services.frontend.tokenizer import ChatTemplateError


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    tokens: list[int]


def tokenize(prep: Preparer, req: TokenizeRequest, max_model_len: int | None) -> dict[str, Any]:
    prep.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("set either prompt or messages", "prompt")
    tok = prep.tokenizer
    if req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        try:
            ids = tok.apply_chat_template(chat_messages(req.messages), req.add_generation_prompt)
        except ChatTemplateError as e:
            raise from_value_error(e, "messages") from None
    strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(prep: Preparer, req: DetokenizeRequest) -> dict[str, Any]:
    prep.check_model(req.model)
    vocab = prep.tokenizer.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"token id {t} at position {i} is not in [0, {vocab})", "tokens")
    return {"prompt": prep.tokenizer.decode(req.tokens)}
