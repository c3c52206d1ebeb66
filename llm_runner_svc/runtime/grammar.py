"""Structured output: a request's constraint compiled into a matcher that says, before each
pick, which tokens keep the output inside the constraint's language, and follows the tokens
picked.

The compiling and matching are llguidance's (a Rust library with no dependencies of its own):
its token tables are built once per tokenizer, from the `tokenizers` serialization where the
tokenizer has one (Hugging Face and GGUF models) or from each id's bytes (llama2.c). A
compiled constraint is kept (least recently used first out) and each request matches on a
copy of it, so admitting the same schema again costs a copy, not a compile. Masks of a whole
step are computed in one call on llguidance's thread pool, without the GIL.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import llguidance

from llm_runner_svc.engines.batch import TokenMask
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.tokenizer import Tokenizer
from llm_runner_svc.runtime.constraint import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

DEFAULT_CACHE_SIZE = 256  # compiled constraints kept
# JSON is written compactly: with free whitespace between tokens a model can spend its whole
# budget on newlines before the first brace (a schema may still ask for it with x-guidance)
_JSON: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(InvalidArgument):
    """A constraint that does not compile: a schema, regex or grammar llguidance refuses."""


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for `constraint`; GrammarError for text that is not what its
    kind says (a schema that is not JSON, a grammar in no syntax it reads)."""
    kind, value = constraint.kind, constraint.value
    try:
        if kind == "json_schema":
            assert isinstance(value, str)
            schema = json.loads(value)
            if not isinstance(schema, dict | bool):
                raise GrammarError("structured output json_schema must be a JSON object, got "
                                   f"{type(schema).__name__}")
            return str(llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON))
        if kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                     defaults=_JSON))
        if kind == "regex":
            assert isinstance(value, str)
            return str(llguidance.LLMatcher.grammar_from_regex(value))
        if kind == "grammar":
            assert isinstance(value, str)
            return str(llguidance.grammar_from("grammar", value))
        assert isinstance(value, tuple)
        return str(llguidance.grammar_from("choice", json.dumps(list(value))))
    except json.JSONDecodeError as exc:
        raise GrammarError(f"structured output json_schema is not JSON: {exc}") from exc
    except ValueError as exc:
        raise GrammarError(f"structured output {kind} does not compile: {exc}") from exc


def build_tokenizer(tokenizer: Tokenizer, vocab_size: int,
                    eos_ids: Collection[int]) -> llguidance.LLTokenizer:
    """llguidance's token tables for `tokenizer`, masks `vocab_size` (the model's) wide."""
    eos = sorted(eos_ids)
    source = tokenizer.tokenizers_json()
    if source is not None:
        return llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos)
    pieces = tokenizer.token_bytes()
    if pieces is None:
        raise InvalidArgument(f"tokenizer {type(tokenizer).__name__} gives neither its "
                              "serialization nor its tokens' bytes: no structured output")
    return llguidance.LLTokenizer(_Wrapped(tokenizer, pieces, eos), n_vocab=vocab_size,
                                  eos_token=eos)


class _Wrapped(llguidance.TokenizerWrapper):
    """A tokenizer given as its tokens' bytes and its encode function."""

    def __init__(self, tokenizer: Tokenizer, pieces: list[bytes], eos: list[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_id
        specials = sorted(tokenizer.special_ids)
        self.special_token_ids = specials
        # a special token's bytes are its text after llguidance's marker byte
        self.tokens = [b"\xff" + p if i in tokenizer.special_ids else p
                       for i, p in enumerate(pieces)]
        self.is_tokenizer_wrapper = True
        self._encode = tokenizer.encode_fragment
        self._accepts_bytes = False

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class Grammars:
    """Compiles constraints for one model's tokenizer; thread-safe (admission compiles on
    worker threads while the stepping thread matches)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Collection[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab_size, tuple(eos_ids)
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.compiles = 0  # constraints compiled (not found in the cache)

    def _tables(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        with self._lock:
            if self._ll is None or self._executor is None:
                self._ll = build_tokenizer(self._tokenizer, self._vocab, self._eos)
                self._executor = llguidance.LLExecutor()
            return self._ll, self._executor

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The compiled constraint in its start state (do not advance it: `matcher` copies
        it); GrammarError when it does not compile."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        ll, _ = self._tables()
        text = grammar_text(constraint)
        compiled = llguidance.LLMatcher(ll, text, log_level=0)
        if compiled.is_error():
            raise GrammarError(f"structured output {constraint.kind} does not compile: "
                               f"{compiled.get_error()}")
        with self._lock:
            self.compiles += 1
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher of `constraint` for one request."""
        compiled = self.compile(constraint)
        _, executor = self._tables()
        return GrammarMatcher(compiled.deep_copy(), executor)


class GrammarMatcher(TokenMask):
    """One request's position in its constraint's language. The stepping thread owns it."""

    def __init__(self, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor) -> None:
        self._m = matcher
        self._executor = executor

    def accept(self, token: int) -> bool:
        """Follow `token`; False when the constraint does not allow it (the matcher is then
        in its error state for good)."""
        return bool(self._m.consume_token(token))

    def roll_back(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""
        if num_tokens and not self._m.rollback(num_tokens):
            raise InvalidArgument(f"structured output cannot roll back {num_tokens} tokens: "
                                  f"{self._m.get_error()}")

    def forks(self, tokens: Sequence[int]) -> list[GrammarMatcher]:
        """len(tokens) + 1 matchers: this one's state past tokens[:j] for each j (copies;
        this one does not advance). The tokens must be allowed (`valid_prefix`)."""
        out = [self]
        for tok in tokens:
            nxt = GrammarMatcher(out[-1]._m.deep_copy(), self._executor)
            if not nxt.accept(tok):
                raise InvalidArgument(f"token {tok} is not allowed here: {nxt.error}")
            out.append(nxt)
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the constraint allows from here (nothing advances)."""
        return int(self._m.validate_tokens(list(tokens)))

    @property
    def is_done(self) -> bool:
        """No token may follow: the output is a whole sentence of the language."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error()) if self._m.is_error() else ""

    @staticmethod
    def fill(masks: Sequence[TokenMask], out: Any) -> None:
        if not masks:
            return
        rows, words = out.shape
        if rows < len(masks) or not out.flags["C_CONTIGUOUS"] or out.itemsize != 4:
            raise InvalidArgument("token mask buffer must be C-contiguous int32 "
                                  f"[>= {len(masks)}, words]")
        first = masks[0]
        assert isinstance(first, GrammarMatcher)
        pairs = []
        for i, m in enumerate(masks):
            assert isinstance(m, GrammarMatcher)
            pairs.append((m._m, i))
        first._executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, words * 4, len(masks))
