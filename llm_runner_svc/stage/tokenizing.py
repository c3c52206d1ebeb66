"""Tokenize and Detokenize: the stage's tokenizer for callers that count or build prompts
themselves (an evaluation harness, a gateway serving `/tokenize`), with no slot and no state.

A prompt tokenizes exactly as Admit tokenizes it (admission.py), so `len(token_ids)` is the
`prompt_tokens` a request with that prompt reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models import Model
from llm_runner_svc.stage.admission import tokenize
from llm_runner_svc.stage.limits import RequestLimits, check_malformed
from llm_runner_svc.stage.request import StageRequest


@dataclass(frozen=True)
class Tokenized:
    """A prompt's ids and the tokenizer's facts."""

    token_ids: tuple[int, ...]
    max_seq: int
    vocab_size: int
    bos_token: str  # "" when the model has none
    eos_token: str  # the first EOS id's text; "" when none
    model: str
    chat_template: str  # the Jinja source; "" when the model has none


def tokenize_alone(model: Model, limits: RequestLimits, max_seq: int,
                   req: StageRequest | None, add_special_tokens: bool) -> Tokenized:
    """`req` None: the empty text, which no request may carry but which tokenizes (to the BOS
    alone, or nothing). Raises InvalidArgument for a prompt Admit would not take as malformed,
    media (their positions depend on encoding the images), or a conversation with no chat
    template."""
    tok = model.tokenizer
    eos = tok.eos_ids[0] if tok.eos_ids else None
    template = model.chat_template.source if model.chat_template is not None else ""

    def answer(ids: tuple[int, ...]) -> Tokenized:
        return Tokenized(ids, max_seq, tok.vocab_size, _text_of(model, tok.bos_id),
                         _text_of(model, eos), model.name, template)

    if req is None:
        return answer(tuple(tok.encode("", add_bos=add_special_tokens
                                       and tok.default_add_bos())))
    check_malformed(limits, max_seq, req)
    if req.num_media:
        raise InvalidArgument("Tokenize takes text, messages or token ids, no media")
    if req.messages is not None and model.chat_template is None:
        raise InvalidArgument(f"model {model.name} has no chat template; send text")
    if req.text is not None and not add_special_tokens:
        return answer(tuple(tok.encode(req.text, add_bos=False)))
    return answer(tokenize(model, req))


def detokenize(model: Model, token_ids: Sequence[int]) -> str:
    """The text of `token_ids`, special tokens included (the model's own decode)."""
    tok = model.tokenizer
    bad = [t for t in token_ids if not 0 <= t < tok.vocab_size]
    if bad:
        raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary "
                              f"(0..{tok.vocab_size - 1})")
    return tok.decode(list(token_ids))


def _text_of(model: Model, token_id: int | None) -> str:
    if token_id is None:
        return ""
    # the vocabulary's own entry (a GGUF's str, llama2c's bytes), else its decoded text
    pieces = getattr(model.tokenizer, "pieces", None)
    piece = pieces[token_id] if pieces is not None else model.tokenizer.decode([token_id])
    text = piece.decode("utf-8", "replace") if isinstance(piece, bytes) else str(piece)
    return text.strip()
