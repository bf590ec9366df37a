"""When an output ends: the one rule every engine applies to each new token, whoever computed it.

Our own engine (``LLMEngine``) and hosted engines (TensorRT-LLM, Triton) both run their output
through this check, so stop tokens, EOS, stop strings and max_tokens end a request identically
(and a request resumed on another kind of engine after a failover agrees on what was released).
"""

from __future__ import annotations

from collections.abc import Collection

from chatmesh.finish import FinishReason
from chatmesh.tokenizer import ChatTokenizer
from engine.detokenizer import Detokenizer
from engine.request import SamplingParams


def check_token(
    params: SamplingParams,
    eos_ids: Collection[int],
    tokenizer: ChatTokenizer,
    detokenizer: Detokenizer,
    token: int,
    num_output: int,
) -> tuple[FinishReason | None, str, str]:
    """Detokenizes output token number ``num_output`` (1-based): (finish reason or None, matched stop,
    released text)."""
    if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
        return FinishReason.STOP, tokenizer.decode([token], skip_control=False), ""
    text = detokenizer.push(token)
    if detokenizer.matched_stop is not None:
        return FinishReason.STOP, detokenizer.matched_stop, text
    if num_output >= params.max_tokens:
        return FinishReason.LENGTH, "", text
    return None, "", text
