"""Captured hidden states of stories260K equal a plain float64 recomputation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_runtime

from llm_runner_svc.runtime import GenerationRequest, SamplingParams


def _reference_states(model, ids: list[int]) -> list[np.ndarray]:
    """Every layer boundary for `ids`, float64, no cache: [embeddings, after layer 1, ...,
    after layer L, post final norm], each [len(ids), hidden]. Written from the llama2.c
    equations, independently of the engine."""
    c, w = model.config, model.weights
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    n, hd = len(ids), c.head_dim
    g = c.num_heads // c.num_kv_heads

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_eps) * f(weight)

    def rope(x):  # x [n, heads, hd], adjacent pairs
        out = x.copy()
        for p in range(n):
            for i in range(0, hd, 2):
                ang = p * c.rope_theta ** (-i / hd)
                a, b = x[p, :, i], x[p, :, i + 1]
                out[p, :, i] = a * np.cos(ang) - b * np.sin(ang)
                out[p, :, i + 1] = a * np.sin(ang) + b * np.cos(ang)
        return out

    x = f(w.embedding)[ids]
    states = [x.copy()]
    for lw in w.layers:
        h = rms(x, lw.attn_norm)
        q = rope((h @ f(lw.wq).T).reshape(n, c.num_heads, hd))
        k = rope((h @ f(lw.wk).T).reshape(n, c.num_kv_heads, hd))
        v = (h @ f(lw.wv).T).reshape(n, c.num_kv_heads, hd)
        att = np.zeros((n, c.num_heads, hd))
        for head in range(c.num_heads):
            kv = head // g
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            s[np.triu_indices(n, 1)] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            att[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(n, -1) @ f(lw.wo).T
        h = rms(x, lw.ffn_norm)
        a, b = h @ f(lw.w_gate).T, h @ f(lw.w_up).T
        x = x + (a / (1 + np.exp(-a)) * b) @ f(lw.w_down).T
        states.append(x.copy())
    states.append(rms(x, w.final_norm))
    return states


@pytest.mark.parametrize("layer, chunk", [(-1, 256), (1, 256), (3, 4), (5, 256)])
def test_prefill_and_decode_states_match_float64(stories, layer, chunk):
    rt = make_runtime(stories, max_batch=2, max_seq=128, hidden_layer=layer, page_size=8,
                      prefill_chunk=chunk)
    prompt = stories.tokenizer.encode("Once upon a time, a dragon")
    req = GenerationRequest("h", prompt, SamplingParams(0.0, 1, 1.0, 12), capture_hidden=True)
    windows, tokens = [], []
    for ev in rt.generate(req):
        windows += ev.hidden
        tokens += ev.token_ids
    rt.close()
    assert len(tokens) == 12
    # the prefill window, then one state per decode step (the last token is never fed)
    assert [h.start_position for h in windows] == [0] + list(range(len(prompt), len(prompt) + 11))
    emb = np.concatenate([h.embeddings for h in windows])
    got = np.concatenate([h.states for h in windows])
    assert got.dtype == np.float32 and got.shape == (len(prompt) + 11, 64)
    ref = _reference_states(stories, prompt + tokens[:-1])
    np.testing.assert_allclose(emb, ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ref[layer], rtol=1e-5, atol=1e-5)


def test_no_capture_unless_asked(stories):
    rt = make_runtime(stories, max_batch=2, max_seq=64, hidden_layer=-1)
    req = GenerationRequest("n", [1, 403], SamplingParams(0.0, 1, 1.0, 4))
    assert all(ev.hidden == [] for ev in rt.generate(req))
    rt.close()
