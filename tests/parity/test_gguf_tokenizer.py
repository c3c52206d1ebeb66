"""SmolLM2's GGUF tokenizer, built on the `tokenizers` library, gives the ids of the format's
own algorithm (llama.cpp's byte-level BPE for `tokenizer.ggml.pre == "smollm"`).

`reference_encode` is that algorithm in plain Python, written from its definition: special
tokens split out first; each digit its own piece, then the GPT-2 split regex on each piece
(text it does not match stays a piece of its own); each piece's UTF-8 bytes mapped to GPT-2's
printable characters; then merges, the lowest rank first (the leftmost on a tie), one at a
time. It is compared with the tokenizer on fixed texts and on fuzzed text.
"""

from __future__ import annotations

import regex
from gguf import GGUFReader
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_runner_svc.models import smollm2_path
from llm_runner_svc.models.gguf_loader import TOKEN_CONTROL, TOKEN_USER_DEFINED, GgufBpeTokenizer

_DIGIT = regex.compile(r"\p{N}")
_GPT2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")


def _byte_chars() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters: printable Latin-1 stays, the rest
    move to 256 and beyond in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class Reference:
    def __init__(self) -> None:
        fields = GGUFReader(smollm2_path(), "r").fields
        self.tokens: list[str] = fields["tokenizer.ggml.tokens"].contents()
        self.types: list[int] = fields["tokenizer.ggml.token_type"].contents()
        self.merges: list[str] = fields["tokenizer.ggml.merges"].contents()
        self.ids = {t: i for i, t in reversed(list(enumerate(self.tokens)))}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(self.merges)}
        specials = [t for t, k in zip(self.tokens, self.types, strict=True)
                    if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and t]
        self.special = regex.compile("|".join(regex.escape(t) for t in
                                              sorted(specials, key=len, reverse=True)))
        self.chars = _byte_chars()

    def tokenizer(self) -> GgufBpeTokenizer:
        return GgufBpeTokenizer(self.tokens, self.types, self.merges, "smollm", 1, [2], False)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        for m in self.special.finditer(text):
            out += self._plain(text[pos:m.start()])
            out.append(self.ids[m.group()])
            pos = m.end()
        return out + self._plain(text[pos:])

    def _plain(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _split(_GPT2, _split(_DIGIT, [text])):
            mapped = "".join(self.chars[b] for b in piece.encode())
            out += [self.ids[s] for s in self._bpe(list(mapped))]
        return out

    def _bpe(self, symbols: list[str]) -> list[str]:
        while len(symbols) > 1:
            ranked = [(self.ranks.get((a, b)), i)
                      for i, (a, b) in enumerate(zip(symbols, symbols[1:], strict=False))]
            found = [(r, i) for r, i in ranked if r is not None]
            if not found:
                break
            _, i = min(found)
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        return symbols


def _split(pattern: regex.Pattern[str], pieces: list[str]) -> list[str]:
    """Every match of `pattern` in each piece, and the text between matches, in order."""
    out: list[str] = []
    for piece in pieces:
        pos = 0
        for m in pattern.finditer(piece):
            if m.start() > pos:
                out.append(piece[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(piece):
            out.append(piece[pos:])
    return out


REF = Reference()
TOK = REF.tokenizer()
TEXTS = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.\n  Indented, naïve café.",
    "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\nHi",
    "   lots   of    spaces\n\n\n\ttabs\t\t and trailing   ", "I'm you're we'll they'd IT'S",
    "2024-12-04 12:30:45.123 $1,000,000 3.14159 ½ ² ٣", "x\n\t2’,3",
    "日本語のテキスト、中文文本。한국어 🙂🚀👍🏽",
    "def f(x):\n    return x**2  # square\n", "a\n\tb\r\nc\u00a0d\u2003e",
]
ALPHABET = "abcXYZ 0129\n\t\r'’éüñ日本🙂.,!?-_()$<|>" + "  "
fuzz_text = st.one_of(
    st.text(alphabet=ALPHABET, max_size=80),
    st.lists(st.sampled_from(["Hello", " world", "<|im_start|>", "<|im_end|>", "\n", "  ",
                              "42", "'s", "日本", "🙂", "\t", " x"]), max_size=20).map("".join))


def test_fixed_texts() -> None:
    for text in TEXTS:
        assert TOK.encode(text, add_bos=False) == REF.encode(text), text
        assert TOK.decode(TOK.encode(text, add_bos=False)) == text


@settings(max_examples=300, deadline=None)
@given(text=fuzz_text)
def test_fuzzed_text(text: str) -> None:
    assert TOK.encode(text, add_bos=False) == REF.encode(text)
