"""Decoder weights as the torch engine holds them: on one device, in the compute dtype, with
q/k/v and gate/up fused so a layer issues four matrix products.

Matrices keep the loaders' [out, in] layout: a decode step is a handful of rows times each
matrix, and with the reduced dimension contiguous in both operands the few-row products read
the weights in long coalesced runs. Norm weights stay float32 (the kernels normalize in
float32 whatever the activation dtype).

Besides the loaders' host weights (any of the three formats), `random_weights` draws weights
at a named real-model shape directly on the device, for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.spec import ModelConfig, ModelWeights, RopeStyle


@dataclass(frozen=True)
class TorchLayer:
    attn_norm: torch.Tensor  # [hidden] float32
    qkv: torch.Tensor  # [q_dim + 2 kv_dim, hidden]
    qkv_bias: torch.Tensor | None  # [q_dim + 2 kv_dim]
    wo: torch.Tensor  # [hidden, q_dim]
    ffn_norm: torch.Tensor  # [hidden] float32
    gate_up: torch.Tensor  # [2 ffn, hidden]
    down: torch.Tensor  # [hidden, ffn]
    q_norm: torch.Tensor | None  # [head_dim] float32
    k_norm: torch.Tensor | None  # [head_dim] float32


@dataclass(frozen=True)
class TorchWeights:
    embedding: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    final_norm: torch.Tensor  # [hidden] float32
    layers: tuple[TorchLayer, ...]

    def step_bytes(self) -> int:
        """Bytes a decode step must read at least: every layer tensor, the head, the norms
        (the embedding table only by the rows it looks up, so not counted)."""
        tensors: list[torch.Tensor] = [self.lm_head, self.final_norm]
        for lw in self.layers:
            tensors += [t for t in vars(lw).values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def load_weights(weights: ModelWeights, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> TorchWeights:
    """Host weights (a loader's float32 arrays) onto `device`, fused, in `dtype`."""
    weights.check(config)

    def mat(*parts: Any) -> torch.Tensor:
        ts = [torch.as_tensor(p).detach().to(device=device, dtype=dtype) for p in parts]
        return ts[0].contiguous() if len(ts) == 1 else torch.cat(ts)

    def vec(a: Any) -> torch.Tensor:
        return torch.as_tensor(a).detach().to(device=device, dtype=torch.float32).contiguous()

    layers = []
    for lw in weights.layers:
        has_bias = config.has_qkv_bias and lw.bq is not None
        layers.append(TorchLayer(
            attn_norm=vec(lw.attn_norm), qkv=mat(lw.wq, lw.wk, lw.wv),
            qkv_bias=mat(lw.bq, lw.bk, lw.bv) if has_bias else None,
            wo=mat(lw.wo), ffn_norm=vec(lw.ffn_norm), gate_up=mat(lw.w_gate, lw.w_up),
            down=mat(lw.w_down),
            q_norm=vec(lw.q_norm) if lw.q_norm is not None else None,
            k_norm=vec(lw.k_norm) if lw.k_norm is not None else None))
    emb = mat(weights.embedding)
    head = emb if weights.lm_head is None else mat(weights.lm_head)
    return TorchWeights(emb, head, vec(weights.final_norm), tuple(layers))


def _qwen25(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, tied: bool,
            vocab: int = 151936) -> ModelConfig:
    return ModelConfig(
        arch="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        max_position=32768, rope_theta=1e6, rope_style=RopeStyle.HALF, rms_eps=1e-6,
        has_qkv_bias=True, tie_embeddings=tied, eos_ids=(151643, 151645))


# Real model shapes (from each model's published config.json), for benchmarks.
NAMED_SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, tied=True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, tied=True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, tied=False, vocab=152064),
}


def named_shape(name: str) -> ModelConfig:
    if name not in NAMED_SHAPES:
        raise InvalidArgument(f"unknown model shape {name!r}; known: {sorted(NAMED_SHAPES)}")
    return NAMED_SHAPES[name]


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   seed: int = 0, std: float = 0.02) -> TorchWeights:
    """Normal(0, std) matrices and biases, norms near 1, drawn on `device` (a 7B shape
    never passes through host memory)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def mat(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, device=device, dtype=dtype)
        return t.normal_(0.0, std, generator=gen)

    def norm(n: int) -> torch.Tensor:
        t = torch.empty(n, device=device, dtype=torch.float32)
        return t.normal_(1.0, 0.1, generator=gen)

    qkv_out = c.q_dim + 2 * c.kv_dim
    layers = tuple(TorchLayer(
        attn_norm=norm(c.hidden_size), qkv=mat(qkv_out, c.hidden_size),
        qkv_bias=mat(qkv_out) if c.has_qkv_bias else None, wo=mat(c.hidden_size, c.q_dim),
        ffn_norm=norm(c.hidden_size), gate_up=mat(2 * c.intermediate_size, c.hidden_size),
        down=mat(c.hidden_size, c.intermediate_size),
        q_norm=norm(c.head_dim) if c.has_qk_norm else None,
        k_norm=norm(c.head_dim) if c.has_qk_norm else None) for _ in range(c.num_layers))
    emb = mat(c.vocab_size, c.hidden_size)
    head = emb if c.tie_embeddings else mat(c.vocab_size, c.hidden_size)
    return TorchWeights(emb, head, norm(c.hidden_size), layers)
