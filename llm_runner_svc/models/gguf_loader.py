"""GGUF checkpoints (llama.cpp's format): llama, qwen2 and qwen3 decoders, gpt2-style BPE.

Every tensor is dequantized to float32 on load with `gguf.quants`; the reader's 2-D data is
already rows = out, so matrices come out [out, in]. llama.cpp's converter permutes q/k of
`llama` models so that RoPE pairs are adjacent (INTERLEAVED); qwen2/qwen3 keep the half split.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants
from gguf.gguf_reader import ReaderTensor
from jinja2 import TemplateError
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

import llm_runner_svc.models.progress as load_progress
from llm_runner_svc.errors import ModelFormatError, NotFound, RunnerError, Unimplemented
from llm_runner_svc.models.chat import ChatTemplate
from llm_runner_svc.models.model import Model
from llm_runner_svc.models.spec import LayerWeights, ModelConfig, ModelWeights, RopeStyle
from llm_runner_svc.models.tokenizer import Tokenizer

_ARCHS: dict[str, RopeStyle] = {
    "llama": RopeStyle.INTERLEAVED, "qwen2": RopeStyle.HALF, "qwen3": RopeStyle.HALF}
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Split regexes llama.cpp applies per `tokenizer.ggml.pre` (llama-vocab.cpp).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")
_PRES = ("default", "gpt2", "llama-bpe", "qwen2", "smollm")


def _splits(*patterns: str) -> pre_tokenizers.PreTokenizer:
    """Each regex splits every piece in turn (matches and gaps kept), then bytes -> chars."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "gpt2":
        return byte_level  # ByteLevel's own regex is the GPT-2 one
    if pre == "llama-bpe":
        return _splits(_LLAMA3_RE)
    if pre == "qwen2":
        return _splits(_QWEN2_RE)
    if pre == "default":
        return _splits(*_DEFAULT_RES)
    raise Unimplemented(
        f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRES)})")


class GgufBpeTokenizer(Tokenizer):
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) on the `tokenizers` package.

    Control and user-defined tokens are added tokens, so `<|im_start|>` in text is one id.
    `decode` keeps their text; it drops the BOS id only when the model adds BOS on its own.
    """

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                 pre: str, bos_id: int | None, eos_ids: Sequence[int], add_bos: bool) -> None:
        vocab: dict[str, int] = {}
        for i, piece in enumerate(tokens):
            vocab.setdefault(piece, i)
        pairs: list[tuple[str, str]] = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ModelFormatError(f"GGUF tokenizer: malformed merge {m!r}")
            pairs.append((a, b))
        pre_tok = _pre_tokenizer(pre)
        try:
            tok = HfTokenizer(models.BPE(vocab=vocab, merges=pairs,
                                         ignore_merges=pre == "llama-bpe"))
        except Exception as exc:  # tokenizers raises bare Exception on a bad vocab/merge
            raise ModelFormatError(f"GGUF tokenizer: cannot build BPE ({exc})") from exc
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        types = list(token_types) or [1] * len(tokens)
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == TOKEN_CONTROL and tokens[i]])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == TOKEN_USER_DEFINED and tokens[i]])
        self._tok = tok
        self._add_bos = add_bos and bos_id is not None
        self.pieces = list(tokens)
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        self._control_ids = frozenset(i for i, t in enumerate(types) if t == TOKEN_CONTROL)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._control_ids | super().special_ids

    def default_add_bos(self) -> bool:
        return self._add_bos

    def tokenizers_json(self) -> str | None:
        return str(self._tok.to_str())

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], after_bos: bool = False) -> str:
        keep: list[int] = []
        for raw in ids:
            tid = int(raw)
            if not 0 <= tid < self.vocab_size:
                raise ModelFormatError(f"token id {tid} is outside the vocabulary")
            if not (self._add_bos and tid == self.bos_id):
                keep.append(tid)
        return self._tok.decode(keep, skip_special_tokens=False)


_MISSING = object()


def _field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise ModelFormatError(f"GGUF metadata {key!r} is missing")
        return default
    return f.contents()


def _int(reader: GGUFReader, key: str, default: Any = _MISSING) -> int:
    v = _field(reader, key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelFormatError(f"GGUF metadata {key!r} should be an integer, got {v!r}")
    return v


def _dequant(t: ReaderTensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        arr = quants.dequantize(t.data, GGMLQuantizationType(t.tensor_type))
    except NotImplementedError as exc:
        raise Unimplemented(f"GGUF tensor {t.name}: {exc}") from exc
    arr = np.asarray(arr, dtype=np.float32)
    if np.may_share_memory(arr, t.data):
        arr = arr.copy()  # detach from the memory-mapped file
    if arr.size != int(np.prod(shape)):
        raise ModelFormatError(f"GGUF tensor {t.name}: {arr.size} values, shape {shape}")
    load_progress.advance(int(t.n_bytes))
    return arr.reshape(shape)


def load_gguf(path: Path) -> Model:
    """Read a GGUF checkpoint; raise ModelFormatError (or Unimplemented) when it cannot."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"GGUF file {str(path)!r} does not exist")
    try:
        return _load(path)
    except ModelFormatError as exc:
        if exc.message.startswith(str(path)):
            raise
        raise ModelFormatError(f"{path}: {exc.message}") from exc
    except RunnerError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OSError, TemplateError) as exc:
        raise ModelFormatError(
            f"{path}: not a valid GGUF file (truncated or corrupt?): "
            f"{type(exc).__name__}: {exc}") from exc


def _load(path: Path) -> Model:
    size_bytes = path.stat().st_size
    load_progress.start(size_bytes, path.name)
    reader = GGUFReader(path, "r")  # parses the metadata: seconds for a large vocabulary
    load_progress.advance(size_bytes - sum(int(t.n_bytes) for t in reader.tensors))
    arch = str(_field(reader, "general.architecture"))
    if arch not in _ARCHS:
        raise Unimplemented(f"GGUF architecture {arch!r} is not supported "
                            f"(supported: {', '.join(sorted(_ARCHS))})")
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelFormatError(f"GGUF tensor {name!r} is missing")
        return _dequant(tensors[name])

    def opt(name: str) -> np.ndarray | None:
        return _dequant(tensors[name]) if name in tensors else None

    tok_model = str(_field(reader, "tokenizer.ggml.model"))
    if tok_model != "gpt2":
        raise Unimplemented(f"GGUF tokenizer model {tok_model!r} is not supported (only 'gpt2')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    bos_key = "tokenizer.ggml.bos_token_id"
    bos = _int(reader, bos_key) if bos_key in reader.fields else None
    eos_ids = [_int(reader, k) for k in ("tokenizer.ggml.eos_token_id",
                                         "tokenizer.ggml.eot_token_id") if k in reader.fields]
    template_src = _field(reader, "tokenizer.chat_template", None)
    if template_src is not None and "<|im_end|>" in template_src and "<|im_end|>" in tokens:
        eos_ids.append(tokens.index("<|im_end|>"))
    tokenizer = GgufBpeTokenizer(
        tokens, _field(reader, "tokenizer.ggml.token_type", []),
        _field(reader, "tokenizer.ggml.merges", []),
        str(_field(reader, "tokenizer.ggml.pre", "default")), bos, eos_ids,
        bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))

    hidden = _int(reader, f"{arch}.embedding_length")
    n_heads = _int(reader, f"{arch}.attention.head_count")
    if n_heads <= 0:
        raise ModelFormatError(f"GGUF metadata {arch}.attention.head_count is {n_heads}")
    lm_head = opt("output.weight")
    has_bias = "blk.0.attn_q.bias" in tensors
    has_qk_norm = "blk.0.attn_q_norm.weight" in tensors
    cfg = ModelConfig(
        arch=arch, vocab_size=len(tokens), hidden_size=hidden,
        intermediate_size=_int(reader, f"{arch}.feed_forward_length"),
        num_layers=_int(reader, f"{arch}.block_count"), num_heads=n_heads,
        num_kv_heads=_int(reader, f"{arch}.attention.head_count_kv", n_heads),
        head_dim=_int(reader, f"{arch}.attention.key_length", hidden // n_heads),
        max_position=_int(reader, f"{arch}.context_length"),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_style=_ARCHS[arch],
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        has_qkv_bias=has_bias, has_qk_norm=has_qk_norm, tie_embeddings=lm_head is None,
        bos_id=tokenizer.bos_id, eos_ids=tokenizer.eos_ids,
    )
    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight"), wq=get(p + "attn_q.weight"),
            wk=get(p + "attn_k.weight"), wv=get(p + "attn_v.weight"),
            wo=get(p + "attn_output.weight"), ffn_norm=get(p + "ffn_norm.weight"),
            w_gate=get(p + "ffn_gate.weight"), w_up=get(p + "ffn_up.weight"),
            w_down=get(p + "ffn_down.weight"),
            bq=opt(p + "attn_q.bias"), bk=opt(p + "attn_k.bias"), bv=opt(p + "attn_v.bias"),
            q_norm=opt(p + "attn_q_norm.weight"), k_norm=opt(p + "attn_k_norm.weight"),
        ))
    rope_freqs = opt("rope_freqs.weight")  # llama3 long-context scaling, kept for reference
    extra = {} if rope_freqs is None else {"rope_freqs": rope_freqs}
    weights = ModelWeights(embedding=get("token_embd.weight"), layers=layers,
                           final_norm=get("output_norm.weight"), lm_head=lm_head, extra=extra)
    weights.check(cfg)

    def piece(tid: int | None) -> str:
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else ""

    chat = None
    if template_src:
        chat = ChatTemplate(str(template_src), bos_token=piece(tokenizer.bos_id),
                            eos_token=piece(eos_ids[0] if eos_ids else None))
    return Model(name=path.stem, format="gguf", config=cfg, weights=weights,
                 tokenizer=tokenizer, chat_template=chat)
