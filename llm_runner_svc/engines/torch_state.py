"""The torch engine's mutable run state: every buffer a forward touches, claimed once.

`rows` is the most positions one forward carries (`pass_tokens`: a step's decode rows and
prefill chunks together; at least `EnginePlan.max_decode_rows`: a step whose verify rows run
as decode rows, K + 1 per row). The decode inputs, logits and picks have a row per decode
row. The KV pool has one page more than the plan: padding rows of a captured batch size read
and write that scratch page, never a request's. The fused products' float32 activations are
needed only by forwards of up to `fused_rows` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.engines.torch_ops import rope_tables
from llm_runner_svc.models.spec import ModelConfig


@dataclass
class RunState:
    x: torch.Tensor  # [rows, hidden] float32 residual stream
    h: torch.Tensor  # [rows, hidden] normed input of a matrix product
    qkv: torch.Tensor  # [rows, q_dim + 2 kv_dim]
    attn: torch.Tensor  # [rows, q_dim]
    gate_up: torch.Tensor  # [rows, 2 ffn]
    act: torch.Tensor  # [rows, ffn]
    qkv_f: torch.Tensor  # [rows, q_dim + 2 kv_dim] float32 | the fused products' float32
    attn_f: torch.Tensor  # [rows, q_dim] float32        | activations (0 rows when the
    act_f: torch.Tensor  # [rows, ffn] float32           | forward has no fused products)
    k_pool: torch.Tensor  # [layers, (pages + 1) * page_size, kv_dim]
    v_pool: torch.Tensor  # [layers, (pages + 1) * page_size, kv_dim]
    logits: torch.Tensor  # [decode_rows, vocab] float32
    next_ids: torch.Tensor  # [decode_rows] int64 greedy picks
    cap_emb: torch.Tensor  # [rows, hidden] float32 staged layer-0 states
    cap_state: torch.Tensor  # [rows, hidden] float32 staged states of the hidden layer
    cos: torch.Tensor  # [max_seq, head_dim / 2] float32
    sin: torch.Tensor  # [max_seq, head_dim / 2] float32
    arange: torch.Tensor  # [max_seq] int32 positions of a prefill window
    inputs: torch.Tensor  # [decode_rows * (3 + pages_per_seq)] int32: ids | positions | LoRA
    #                       adapter slots | tables
    x_last: torch.Tensor  # [max_batch + 1, hidden] float32 residual rows of prefill chunks'
    #                       last tokens by batch row; the extra row takes chunks whose row
    #                       goes on in a later pass
    wide: torch.Tensor  # [max(rows * hidden, decode_rows * vocab)] product scratch, if needed

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))

    @property
    def pages_per_seq(self) -> int:
        return self.inputs.numel() // self.logits.shape[0] - 3


def pass_tokens(plan: EnginePlan) -> int:
    """Tokens in one forward: a whole step under the runtime's budget (so a step reads the
    weights once), and at least a decode batch or a prefill chunk."""
    return max(plan.max_tokens, plan.step_tokens)


def decode_views(state: RunState, batch: int) -> tuple[torch.Tensor, ...]:
    """ids [batch], positions [batch], tables [batch, pages] of the packed decode inputs."""
    pages = state.pages_per_seq
    inputs = state.inputs
    return (inputs[:batch], inputs[batch:2 * batch],
            inputs[3 * batch:batch * (3 + pages)].view(batch, pages))


def decode_adapters(state: RunState, batch: int) -> torch.Tensor:
    """The LoRA adapter slot of each row [batch] int32 (0: the base model) of the packed
    decode inputs."""
    return state.inputs[2 * batch:3 * batch]


def allocate_state(config: ModelConfig, plan: EnginePlan, device: torch.device,
                   dtype: torch.dtype, has_wide_scratch: bool, fused_rows: int) -> RunState:
    c = config
    max_batch, decode_rows = plan.max_batch, plan.max_decode_rows
    rows = max(pass_tokens(plan), decode_rows)
    pages_per_seq = -(-plan.max_seq // plan.page_size)
    pool_rows = (plan.num_pages + 1) * plan.page_size
    cos, sin = rope_tables(plan.max_seq, c.head_dim, c.rope_theta, device)
    cap_rows = rows if plan.hidden_layer is not None else 0
    f_rows = min(rows, fused_rows)

    def act(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=device, dtype=dtype)

    def f32(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=device, dtype=torch.float32)

    scratch = plan.num_pages  # page id of the scratch page
    inputs = torch.full((decode_rows * (3 + pages_per_seq),), scratch, dtype=torch.int32,
                        device=device)
    inputs[:3 * decode_rows] = 0
    return RunState(
        x=f32(rows, c.hidden_size), h=act(rows, c.hidden_size),
        qkv=act(rows, c.q_dim + 2 * c.kv_dim), attn=act(rows, c.q_dim),
        gate_up=act(rows, 2 * c.intermediate_size), act=act(rows, c.intermediate_size),
        qkv_f=f32(f_rows, c.q_dim + 2 * c.kv_dim), attn_f=f32(f_rows, c.q_dim),
        act_f=f32(f_rows, c.intermediate_size),
        k_pool=act(c.num_layers, pool_rows, c.kv_dim), v_pool=act(c.num_layers, pool_rows,
                                                                  c.kv_dim),
        logits=f32(decode_rows, c.vocab_size),
        next_ids=torch.zeros(decode_rows, dtype=torch.int64, device=device),
        cap_emb=f32(cap_rows, c.hidden_size), cap_state=f32(cap_rows, c.hidden_size),
        cos=cos, sin=sin,
        arange=torch.arange(plan.max_seq, dtype=torch.int32, device=device),
        inputs=inputs, x_last=f32(max_batch + 1, c.hidden_size),
        wide=act(max(rows * c.hidden_size, decode_rows * c.vocab_size) if has_wide_scratch
                 else 0))
