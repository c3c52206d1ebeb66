"""Log-probabilities in OpenAI's two shapes, from the stage's token ids and the text of each
token on its own (the stage tokenizer's, through Detokenize: a token that is part of one UTF-8
character reads as U+FFFD on its own; `bytes` are that text's UTF-8 bytes).

- chat: `choices[].logprobs.content[]` = {token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}]}, the top k likeliest first.
- completions: `choices[].logprobs` = {tokens, token_logprobs, top_logprobs, text_offset};
  each top_logprobs entry maps token text -> log-probability for the top k and the token
  itself (OpenAI's "logprobs + 1 at most"); an echoed prompt's first token has null for
  both (nothing comes before it); `text_offset` is each token's offset in the choice's text,
  counted in the tokens' texts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.upstream import TokenLogprob


@dataclass(frozen=True)
class Position:
    """One token of a completion's logprobs: its log-probability and alternatives, both None
    for an echoed prompt's first token."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None

    @classmethod
    def of(cls, lp: TokenLogprob) -> Position:
        return cls(lp.token_id, lp.logprob, lp.top)


def ids_of(items: Iterable[TokenLogprob | Position]) -> set[int]:
    """Every token id the shapes of `items` name (for token_texts)."""
    out: set[int] = set()
    for item in items:
        out.add(item.token_id)
        out.update(i for i, _ in item.top or ())
    return out


def prompt_positions(first_id: int, rest: Sequence[TokenLogprob]) -> list[Position]:
    """An echoed prompt's positions: its first token (no log-probability) then the rest."""
    return [Position(first_id, None, None), *(Position.of(lp) for lp in rest)]


def chat_content(items: Sequence[TokenLogprob], texts: dict[int, str]) -> list[dict[str, Any]]:
    """The entries of a chat choice's (or chunk's) logprobs.content."""
    return [{**_token(lp.token_id, lp.logprob, texts),
             "top_logprobs": [_token(i, v, texts) for i, v in lp.top]} for lp in items]


def _token(token_id: int, logprob: float, texts: dict[int, str]) -> dict[str, Any]:
    text = texts[token_id]
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class CompletionLogprobs:
    """A completion choice's logprobs, built in pieces (one per stream chunk) whose
    text_offset goes on from the pieces before."""

    def __init__(self) -> None:
        self.offset = 0

    def shape(self, positions: Sequence[Position], texts: dict[int, str]) -> dict[str, Any]:
        tokens, offsets = [], []
        for p in positions:
            tokens.append(texts[p.token_id])
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        tops: list[dict[str, float] | None] = []
        for p in positions:
            if p.top is None or p.logprob is None:
                tops.append(None)
                continue
            top = {texts[i]: v for i, v in p.top}
            top.setdefault(texts[p.token_id], p.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [p.logprob for p in positions],
                "top_logprobs": tops, "text_offset": offsets}
