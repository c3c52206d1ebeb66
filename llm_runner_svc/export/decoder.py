"""Our model description -> an ONNX decoder step (see `signature` for the IO contract).

Built op by op with `onnx.helper` from the host weights, no torch. Per layer: RMSNorm (float32),
one fused q|k|v MatMul (+ bias), q/k RMSNorm for Qwen3, RoPE as `x * cos + x[partner] * sin'`
(a Gather that swaps each rotated pair, adjacent pairs or halves from the model's RopeStyle,
and a sin table whose first member of each pair is negated: no GEMM, so SM75 fp16 plans build),
GQA as one broadcasting MatMul over
[batch, kv_heads, group, seq, head_dim], softmax in float32 with the caller's additive bias,
then the fused gate|up MatMul, SiLU and down. In fp16/bf16 exports the weights, the KV
tensors and the weight MatMuls take the low precision; the residual stream, norms, RoPE,
softmax and (unless `is_attention_low`, which SM75 plans need) the attention MatMuls stay
float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from llm_runner_svc.engines.numpy_kernels import rope_tables
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.export import signature as sig
from llm_runner_svc.export.onnx_builder import ELEM, FLOAT, GraphBuilder
from llm_runner_svc.export.signature import GraphDtype
from llm_runner_svc.models.spec import LayerWeights, ModelConfig, ModelWeights, RopeStyle


@dataclass(frozen=True)
class ExportOptions:
    """What one export bakes in."""

    dtype: GraphDtype = GraphDtype.FP32
    hidden_layer: int | None = None  # accept_hidden_layer; None = no hidden outputs
    max_positions: int = 0  # rows of the RoPE tables; 0 = the model's context
    # fp16/bf16: attention MatMuls in the low precision too (SM75 has no fp32 GEMM); by
    # default they read the low-precision KV but compute in float32
    is_attention_low: bool = False

    def positions(self, config: ModelConfig) -> int:
        return self.max_positions or config.max_position


def rope_pairs(head_dim: int, style: RopeStyle) -> tuple[list[int], np.ndarray]:
    """The partner of each dimension and the sign its partner takes: rotating (a, b) gives
    a' = a cos - b sin, b' = b cos + a sin."""
    partner = list(range(head_dim))
    sign = np.ones(head_dim, np.float32)
    half = head_dim // 2
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if style is RopeStyle.INTERLEAVED else (i, i + half)
        partner[a], partner[b] = b, a
        sign[a] = -1.0
    return partner, sign


def _full_tables(config: ModelConfig, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin [positions, head_dim] laid out like the rotated pairs."""
    cos, sin = rope_tables(num_positions, config.head_dim, config.rope_theta)
    if config.rope_style is RopeStyle.INTERLEAVED:
        cos, sin = np.repeat(cos, 2, axis=1), np.repeat(sin, 2, axis=1)
    else:
        cos, sin = np.concatenate([cos, cos], axis=1), np.concatenate([sin, sin], axis=1)
    return cos, sin * rope_pairs(config.head_dim, config.rope_style)[1]


class _DecoderGraph:
    def __init__(self, config: ModelConfig, weights: ModelWeights, opts: ExportOptions) -> None:
        self.c, self.w, self.opts = config, weights, opts
        self.g = GraphBuilder(f"{config.arch}_decoder_step")
        self.low = ELEM[opts.dtype]  # element type of MatMul operands and KV

    def build(self) -> onnx.ModelProto:
        c, g, opts = self.c, self.g, self.opts
        cos_t, sin_t = _full_tables(c, opts.positions(c))
        # [batch, 1, seq, head_dim] float32, shared by every layer
        cos = g.op("Unsqueeze", g.op("Gather", g.weight("rope_cos", cos_t), sig.POSITION_IDS),
                   g.ints("axis1", [1]))
        sin = g.op("Unsqueeze", g.op("Gather", g.weight("rope_sin", sin_t), sig.POSITION_IDS),
                   g.ints("axis1", [1]))
        partner = g.ints("rope_partner", rope_pairs(c.head_dim, c.rope_style)[0])
        emb = g.weight("embedding", self.w.embedding, opts.dtype)  # [vocab, hidden]
        x = g.cast(g.op("Gather", emb, sig.INPUT_IDS), FLOAT, self.low)  # [b, s, hidden] f32
        hidden_layer = opts.hidden_layer
        if hidden_layer is not None:
            if not (hidden_layer == -1 or 1 <= hidden_layer <= c.num_layers):
                raise InvalidArgument(f"accept_hidden_layer must be -1 or in 1..{c.num_layers}, "
                                      f"got {hidden_layer}")
            g.node("Identity", [x], outputs=[sig.HIDDEN_EMBED])
        for i, lw in enumerate(self.w.layers):
            x = self._layer(i, lw, x, cos, sin, partner)
            if hidden_layer == i + 1:
                g.node("Identity", [x], outputs=[sig.HIDDEN_STATE])
        if hidden_layer == -1:
            g.node("Identity", [g.rms_norm(x, self.w.final_norm, c.rms_eps)],
                   outputs=[sig.HIDDEN_STATE])
        # each row's last position: x[:, seq - 1, :] -> [b, hidden]
        seq_len = g.op("Gather", g.op("Shape", x), g.ints("dim1", [1]))
        last_idx = g.op("Squeeze", g.op("Sub", seq_len, g.ints("one", [1])))
        last = g.rms_norm(g.op("Gather", x, last_idx, axis=1), self.w.final_norm, c.rms_eps)
        head = self.w.lm_head if self.w.lm_head is not None else None
        head_name = emb if head is None else g.weight("lm_head", head, opts.dtype)
        logits = g.op("Gemm", g.cast(last, self.low, FLOAT), head_name, transB=1)
        g.node("Cast", [logits], outputs=[sig.LOGITS], to=FLOAT)
        return g.model(*self._value_infos())

    def _matmul(self, x: str, w_out_in: np.ndarray, hint: str) -> str:
        """x (float32) @ W^T in the low precision; the result back in float32."""
        w = self.g.weight(hint, np.ascontiguousarray(w_out_in.T), self.opts.dtype)
        return self.g.cast(self.g.op("MatMul", self.g.cast(x, self.low, FLOAT), w), FLOAT,
                           self.low)

    def _layer(self, i: int, lw: LayerWeights, x: str, cos: str, sin: str,
               partner: str) -> str:
        c, g = self.c, self.g
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        h = g.rms_norm(x, lw.attn_norm, c.rms_eps)
        qkv = self._matmul(h, np.concatenate([lw.wq, lw.wk, lw.wv]), f"l{i}_qkv")
        if c.has_qkv_bias and lw.bq is not None and lw.bk is not None and lw.bv is not None:
            bias = np.concatenate([lw.bq, lw.bk, lw.bv])
            qkv = g.op("Add", qkv, g.weight(f"l{i}_qkv_bias", bias))
        q, k, v = g.node("Split", [qkv, g.ints("split", [c.q_dim, c.kv_dim, c.kv_dim])], 3,
                         axis=-1)

        def heads(t: str, n: int, norm: np.ndarray | None) -> str:
            """[b, s, n * hd] -> [b, n, s, hd], q/k norm per head when the model has one."""
            t = g.op("Reshape", t, g.ints("shape", [0, 0, n, hd]))
            if norm is not None:
                t = g.rms_norm(t, norm, c.rms_eps)
            return g.op("Transpose", t, perm=[0, 2, 1, 3])

        def rope(t: str) -> str:
            swapped = g.op("Gather", t, partner, axis=-1)
            return g.op("Add", g.op("Mul", t, cos), g.op("Mul", swapped, sin))

        q = rope(heads(q, nh, lw.q_norm if c.has_qk_norm else None))
        k_new = g.node("Cast", [rope(heads(k, nkv, lw.k_norm if c.has_qk_norm else None))],
                       outputs=[sig.new_key(i)], to=self.low)[0]
        v_new = g.node("Cast", [heads(v, nkv, None)], outputs=[sig.new_value(i)], to=self.low)[0]
        att = self.low if self.opts.is_attention_low else FLOAT  # attention MatMul type
        keys = g.cast(g.op("Concat", sig.past_key(i), k_new, axis=2), att, self.low)
        vals = g.cast(g.op("Concat", sig.past_value(i), v_new, axis=2), att, self.low)
        # GQA: q [b, kv, group, s, hd] against keys [b, kv, 1, hd, total]
        q5 = g.op("Reshape", g.op("Mul", q, g.scalar("scale", 1.0 / np.sqrt(hd))),
                  g.ints("shape", [0, nkv, nh // nkv, -1, hd]))
        keys_t = g.op("Unsqueeze", g.op("Transpose", keys, perm=[0, 1, 3, 2]), g.ints("ax", [2]))
        scores = g.cast(g.op("MatMul", g.cast(q5, att, FLOAT), keys_t), FLOAT, att)
        probs = g.op("Softmax", g.op("Add", scores, sig.ATTENTION_BIAS), axis=-1)
        ctx = g.op("MatMul", g.cast(probs, att, FLOAT),
                   g.op("Unsqueeze", vals, g.ints("ax", [2])))  # [b, kv, group, s, hd]
        ctx = g.op("Reshape", ctx, g.ints("shape", [0, nh, -1, hd]))
        ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]),
                   g.ints("shape", [0, 0, c.q_dim]))
        x = g.op("Add", x, self._matmul(g.cast(ctx, FLOAT, att), lw.wo, f"l{i}_wo"))
        h = g.rms_norm(x, lw.ffn_norm, c.rms_eps)
        gate_up = self._matmul(h, np.concatenate([lw.w_gate, lw.w_up]), f"l{i}_gate_up")
        gate, up = g.node("Split", [gate_up, g.ints("split", [c.intermediate_size] * 2)], 2,
                          axis=-1)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
        return g.op("Add", x, self._matmul(act, lw.w_down, f"l{i}_down"))

    def _value_infos(self) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
        elem = {"int64": onnx.TensorProto.INT64, "float32": FLOAT,
                self.opts.dtype.element: self.low}
        ins: list[onnx.ValueInfoProto] = []
        outs: list[onnx.ValueInfoProto] = []
        for t in sig.io_tensors(self.c, self.opts.dtype, self.opts.hidden_layer is not None):
            info = helper.make_tensor_value_info(t.name, elem[t.element], list(t.dims))
            (ins if t.is_input else outs).append(info)
        return ins, outs


def export_decoder(config: ModelConfig, weights: ModelWeights,
                   options: ExportOptions | None = None) -> onnx.ModelProto:
    """Build the step graph of `config` with `weights`; the result passes `onnx.checker`."""
    weights.check(config)
    model = _DecoderGraph(config, weights, options or ExportOptions()).build()
    onnx.checker.check_model(model)
    return model
