"""Hugging Face directories: the loader against the checkpoint transformers wrote, and the
numpy engine's logits against transformers' own forward pass."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llm_runner_svc.engines.base import DecodeRow, EnginePlan, SampleSpec  # noqa: E402
from llm_runner_svc.engines.numpy_engine import NumpyEngine  # noqa: E402
from llm_runner_svc.errors import ModelFormatError, NotFound, Unimplemented  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402
from llm_runner_svc.models.hf import HfTokenizer  # noqa: E402
from llm_runner_svc.models.spec import RopeStyle  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3"]


def _np(t: Any) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _assert_weights_equal(model: Any, torch_model: Any) -> None:
    sd = torch_model.state_dict()
    w, cfg = model.weights, model.config
    np.testing.assert_array_equal(w.embedding, _np(sd["model.embed_tokens.weight"]))
    np.testing.assert_array_equal(w.final_norm, _np(sd["model.norm.weight"]))
    if cfg.tie_embeddings:
        assert w.lm_head is None
    else:
        np.testing.assert_array_equal(w.lm_head, _np(sd["lm_head.weight"]))
    names = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
             "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "wo": "self_attn.o_proj.weight", "ffn_norm": "post_attention_layernorm.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight"}
    if cfg.has_qkv_bias:
        names |= {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
                  "bv": "self_attn.v_proj.bias"}
    if cfg.has_qk_norm:
        names |= {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
    for i, lw in enumerate(w.layers):
        for ours, theirs in names.items():
            arr = getattr(lw, ours)
            assert arr.dtype == np.float32
            np.testing.assert_array_equal(arr, _np(sd[f"model.layers.{i}.{theirs}"]), ours)


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("arch", ARCHS)
def test_load_config_and_weights(arch: str, hf_model_dir: Any) -> None:
    path, tm = hf_model_dir(arch)
    model = load_model(path)
    cfg, hcfg = model.config, tm.config
    assert model.format == "hf" and model.name == arch
    assert cfg.arch == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (320, 64, 128)
    assert cfg.num_layers == hcfg.num_hidden_layers
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.max_position == 256
    assert cfg.rope_style is RopeStyle.HALF
    assert cfg.rope_theta == hcfg.rope_parameters["rope_theta"]
    assert cfg.rms_eps == hcfg.rms_norm_eps
    assert cfg.has_qkv_bias == (arch == "qwen2")
    assert cfg.has_qk_norm == (arch == "qwen3")
    assert not cfg.tie_embeddings
    if arch == "llama":
        assert (cfg.bos_id, cfg.eos_ids) == (0, (1,))
    else:  # no BOS in tokenizer_config; eos from config.json plus tokenizer_config's <|im_end|>
        assert cfg.bos_id is None
        assert set(cfg.eos_ids) == ({0, 2} if arch == "qwen2" else {2})
    _assert_weights_equal(model, tm)


def test_tied_embeddings(hf_model_dir: Any) -> None:
    path, tm = hf_model_dir("llama", tie_word_embeddings=True)  # SmolLM style
    model = load_model(path)
    assert model.config.tie_embeddings and model.weights.lm_head is None
    _assert_weights_equal(model, tm)


def test_llama_attention_bias(hf_model_dir: Any) -> None:
    path, tm = hf_model_dir("llama", attention_bias=True)
    with torch.no_grad():  # o_proj carries a bias too; zero it so the checkpoint is loadable
        for layer in tm.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    tm.save_pretrained(str(path), safe_serialization=True)
    model = load_model(path)
    assert model.config.has_qkv_bias
    _assert_weights_equal(model, tm)


def test_o_proj_bias_is_rejected(hf_model_dir: Any) -> None:
    path, _ = hf_model_dir("llama", attention_bias=True)  # random, non-zero o_proj bias
    with pytest.raises(Unimplemented, match="o_proj"):
        load_model(path)


def test_bf16_checkpoint(hf_model_dir: Any) -> None:
    path, tm = hf_model_dir("qwen2", dtype=torch.bfloat16)
    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    _assert_weights_equal(load_model(path), tm)  # tm holds the bf16 values widened


def test_sharded_checkpoint(hf_model_dir: Any) -> None:
    path, tm = hf_model_dir("qwen3", save_kwargs={"max_shard_size": "100KB"})
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    _assert_weights_equal(load_model(path), tm)


def test_missing_weights(hf_model_dir: Any) -> None:
    path, _ = hf_model_dir("llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(NotFound, match="safetensors"):
        load_model(path)


def test_missing_shard(hf_model_dir: Any) -> None:
    path, _ = hf_model_dir("llama", save_kwargs={"max_shard_size": "100KB"})
    sorted(path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(NotFound, match="model-"):
        load_model(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 20])
def test_truncated_weights(keep: float, hf_model_dir: Any) -> None:
    path, _ = hf_model_dir("llama")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:int(len(data) * keep)] if keep < 1 else data[:int(keep)])
    with pytest.raises(ModelFormatError, match="model.safetensors.*not a valid safetensors"):
        load_model(path)


def test_missing_tokenizer(hf_model_dir: Any) -> None:
    path, _ = hf_model_dir("qwen2")
    (path / "tokenizer.json").unlink()
    with pytest.raises(NotFound, match="tokenizer.json"):
        load_model(path)


@pytest.mark.parametrize(("changes", "match"), [
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
    ({"use_sliding_window": True, "sliding_window": 64}, "sliding window"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     "sliding window"),
])
def test_unsupported_configs(changes: dict[str, Any], match: str, hf_model_dir: Any,
                             edit_config: Any) -> None:
    path, _ = hf_model_dir("qwen2")
    edit_config(path / "config.json", **changes)
    with pytest.raises(Unimplemented, match=match):
        load_model(path)


def test_default_rope_scaling_is_accepted(hf_model_dir: Any, edit_config: Any) -> None:
    path, _ = hf_model_dir("llama")
    edit_config(path / "config.json", rope_scaling={"type": "default"}, rope_parameters=None,
                rope_theta=20000.0)  # the pre-5.0 transformers layout
    assert load_model(path).config.rope_theta == 20000.0


# ---------------------------------------------------------------------------- tokenizer


def test_llama_tokenizer_bos(hf_model_dir: Any, edit_config: Any) -> None:
    path, _ = hf_model_dir("llama")
    tok = load_model(path).tokenizer
    assert isinstance(tok, HfTokenizer)
    assert tok.default_add_bos() and tok.bos_id == 0 and tok.eos_ids == (1,)
    text = "Hello, world! The quick fox."
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == 0 and ids.count(0) == 1
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([*ids, 1]) == text + "</s>"  # specials other than BOS are kept
    edit_config(path / "tokenizer_config.json", add_bos_token=False)
    assert not load_model(path).tokenizer.default_add_bos()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_tokenizer_and_chat_template(arch: str, hf_model_dir: Any) -> None:
    path, _ = hf_model_dir(arch)
    model = load_model(path)
    tok = model.tokenizer
    assert not tok.default_add_bos() and tok.bos_id is None
    assert tok.encode("hi there", add_bos=True) == tok.encode("hi there", add_bos=False)
    assert model.chat_template is not None
    prompt = model.chat_template.render([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_bos=False)
    assert ids[0] == 1 and ids.count(2) == 1  # specials are single tokens
    assert tok.decode(ids) == prompt


# ---------------------------------------------------------------------------- parity

# Criterion: np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * max|theirs|) on
# the full-vocabulary logits of every step, i.e. each logit within 1e-4 relative of itself or
# 1e-4 of the step's largest logit magnitude. The reference is transformers' float32 eager
# forward over the whole sequence so far (no KV cache), so the engine's paged cache, chunked
# prefill and decode path are all checked against a cache-free computation.
RTOL = 1e-4
PROMPT_LEN = 12
DECODE_STEPS = 16
GREEDY = SampleSpec(temperature=0.0, top_k=0, top_p=1.0)


def _reference_logits(tm: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = tm(torch.tensor([ids]), use_cache=False).logits
    return out[0, -1].to(torch.float32).numpy()


def _check(ours: np.ndarray, theirs: np.ndarray, what: str) -> float:
    scale = float(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=RTOL * scale, err_msg=what)
    return float(np.abs(ours - theirs).max()) / scale


@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),  # SmolLM style
    ("qwen2", {}),
    ("qwen3", {}),
], ids=["llama", "llama-tied", "qwen2", "qwen3"])
@pytest.mark.parametrize("prefill_chunk", [256, 5])
def test_numpy_engine_matches_transformers(arch: str, overrides: dict[str, Any],
                                           prefill_chunk: int, hf_model_dir: Any) -> None:
    path, tm = hf_model_dir(arch, **overrides)
    model = load_model(path)
    engine = NumpyEngine(model.config, model.weights)
    page_size = 8
    engine.preallocate(EnginePlan(max_batch=1, max_seq=64, page_size=page_size, num_pages=8,
                                  prefill_chunk=prefill_chunk))
    pages = [5, 2, 7, 0]  # non-contiguous, enough for PROMPT_LEN + DECODE_STEPS positions
    rng = np.random.default_rng(1234)
    ids = [int(t) for t in rng.integers(0, model.config.vocab_size, PROMPT_LEN)]

    engine.prefill(ids, 0, pages)
    worst = _check(engine.logits(1)[0], _reference_logits(tm, ids), "prefill")
    ours_tokens: list[int] = []
    ref_tokens: list[int] = []
    for step in range(DECODE_STEPS):
        ref = _reference_logits(tm, ids)
        if step:  # step 0's logits are the prefill's, checked above
            worst = max(worst, _check(engine.logits(1)[0], ref, f"decode step {step}"))
        tok = engine.sample([GREEDY])[0]
        ours_tokens.append(tok)
        ref_tokens.append(int(np.argmax(ref)))
        assert tok == ref_tokens[-1], f"greedy token differs at step {step}"
        pos = len(ids)
        ids.append(tok)
        engine.decode([DecodeRow(token_id=tok, position=pos,
                                 page_table=pages[:pos // page_size + 1])])
    assert _check(engine.logits(1)[0], _reference_logits(tm, ids), "last step") <= RTOL
    assert ours_tokens == ref_tokens
    print(f"{arch}: worst |diff| / max|logit| = {worst:.2e}; tokens {ours_tokens}")
    engine.close()
