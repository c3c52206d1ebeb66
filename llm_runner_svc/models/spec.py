"""Architecture facts and host weights of a Llama-family decoder, independent of format."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from llm_runner_svc.errors import ModelFormatError


class RopeStyle(StrEnum):
    """How a head's dimensions are paired for rotation.

    INTERLEAVED rotates (x0, x1), (x2, x3), ... (llama2.c, GGUF llama);
    HALF rotates (x_i, x_{i + d/2}) (Hugging Face `rotate_half`, GGUF qwen2/qwen3).
    """

    INTERLEAVED = "interleaved"
    HALF = "half"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder; validated on construction."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rope_style: RopeStyle = RopeStyle.INTERLEAVED
    rms_eps: float = 1e-5
    has_qkv_bias: bool = False
    has_qk_norm: bool = False
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"model config: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(
                f"model config: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelFormatError("model config: head_dim must be even for RoPE")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    """One decoder layer, float32, matrices in [out, in] layout."""

    attn_norm: np.ndarray  # [hidden]
    wq: np.ndarray  # [q_dim, hidden]
    wk: np.ndarray  # [kv_dim, hidden]
    wv: np.ndarray  # [kv_dim, hidden]
    wo: np.ndarray  # [hidden, q_dim]
    ffn_norm: np.ndarray  # [hidden]
    w_gate: np.ndarray  # [intermediate, hidden]
    w_up: np.ndarray  # [intermediate, hidden]
    w_down: np.ndarray  # [hidden, intermediate]
    bq: np.ndarray | None = None  # [q_dim]
    bk: np.ndarray | None = None  # [kv_dim]
    bv: np.ndarray | None = None  # [kv_dim]
    q_norm: np.ndarray | None = None  # [head_dim]
    k_norm: np.ndarray | None = None  # [head_dim]


@dataclass
class ModelWeights:
    """All weights of a decoder on the host, float32."""

    embedding: np.ndarray  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray | None = None  # [vocab, hidden]; None when tied to the embedding
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def check(self, cfg: ModelConfig) -> None:
        """Raise ModelFormatError unless every tensor has the shape `cfg` implies."""
        h, kv, q, ff = cfg.hidden_size, cfg.kv_dim, cfg.q_dim, cfg.intermediate_size
        expect: list[tuple[str, np.ndarray | None, tuple[int, ...]]] = [
            ("embedding", self.embedding, (cfg.vocab_size, h)),
            ("final_norm", self.final_norm, (h,)),
        ]
        if not cfg.tie_embeddings:
            expect.append(("lm_head", self.lm_head, (cfg.vocab_size, h)))
        if len(self.layers) != cfg.num_layers:
            raise ModelFormatError(
                f"model has {len(self.layers)} layers, config says {cfg.num_layers}")
        for i, lw in enumerate(self.layers):
            p = f"layers.{i}."
            expect += [
                (p + "attn_norm", lw.attn_norm, (h,)), (p + "wq", lw.wq, (q, h)),
                (p + "wk", lw.wk, (kv, h)), (p + "wv", lw.wv, (kv, h)),
                (p + "wo", lw.wo, (h, q)), (p + "ffn_norm", lw.ffn_norm, (h,)),
                (p + "w_gate", lw.w_gate, (ff, h)), (p + "w_up", lw.w_up, (ff, h)),
                (p + "w_down", lw.w_down, (h, ff)),
            ]
            if cfg.has_qkv_bias:
                expect += [(p + "bq", lw.bq, (q,)), (p + "bk", lw.bk, (kv,)),
                           (p + "bv", lw.bv, (kv,))]
            if cfg.has_qk_norm:
                expect += [(p + "q_norm", lw.q_norm, (cfg.head_dim,)),
                           (p + "k_norm", lw.k_norm, (cfg.head_dim,))]
        for name, arr, shape in expect:
            if arr is None:
                raise ModelFormatError(f"weight {name} is missing")
            if tuple(arr.shape) != shape:
                raise ModelFormatError(
                    f"weight {name} has shape {tuple(arr.shape)}, expected {shape}")
