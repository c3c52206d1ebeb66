"""Tokenizer interface and the incremental detokenizer used while streaming."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tokenizer(ABC):
    """Text <-> token ids. Implementations are immutable and thread-safe after construction."""

    bos_id: int | None
    eos_ids: tuple[int, ...]
    vocab_size: int

    @abstractmethod
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; a BOS id first when `add_bos` and the model has one."""

    @abstractmethod
    def decode(self, ids: Sequence[int], after_bos: bool = False) -> str:
        """Text of `ids`; `after_bos` says they follow a BOS (llama2.c drops a leading space)."""

    def default_add_bos(self) -> bool:
        """Whether a plain prompt gets a BOS (format-specific)."""
        return self.bos_id is not None

    def encode_fragment(self, text: str) -> list[int]:
        """Ids of `text` as it would continue other text: no BOS, no dummy-prefix space."""
        return self.encode(text, add_bos=False)

    def tokenizers_json(self) -> str | None:
        """The whole tokenizer as the `tokenizers` library serializes it, for a tokenizer
        built on that library (structured output builds its token tables from it)."""
        return None

    def token_bytes(self) -> list[bytes] | None:
        """The bytes each id stands for (a special token: its text), for a tokenizer not
        built on `tokenizers`."""
        return None

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that are markers, not text: generated ones add nothing to the output text (a
        request with ignore_eos generates past its EOS). BOS and EOS unless a format knows
        more (a GGUF's control tokens)."""
        bos = () if self.bos_id is None else (self.bos_id,)
        return frozenset((*bos, *self.eos_ids))


class StreamDecoder:
    """Turns a growing list of generated ids into text deltas without splitting UTF-8
    characters; the tokenizer's special ids (EOS, chat markers) give no text.

    Keeps a small window: the text of ids[prefix:read] was already emitted; each push decodes
    ids[prefix:] and emits what is new, holding back while the tail is an incomplete character.
    """

    def __init__(self, tokenizer: Tokenizer, after_bos: bool) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._after_bos = after_bos
        self._special = tokenizer.special_ids
        self.text = ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (may be empty)."""
        special = self._special
        self._ids.extend(i for i in new_ids if i not in special)
        after_bos = self._after_bos and self._prefix == 0
        old = self._tok.decode(self._ids[self._prefix:self._read], after_bos)
        new = self._tok.decode(self._ids[self._prefix:], after_bos)
        if new.endswith("\ufffd") or len(new) <= len(old):
            return ""
        delta = new[len(old):]
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix > 0:
            self._after_bos = False
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (a trailing incomplete character becomes U+FFFD)."""
        after_bos = self._after_bos and self._prefix == 0
        old = self._tok.decode(self._ids[self._prefix:self._read], after_bos)
        new = self._tok.decode(self._ids[self._prefix:], after_bos)
        delta = new[len(old):] if new.startswith(old) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
