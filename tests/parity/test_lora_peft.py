"""LoRA adapters made by the `peft` package against transformers + peft on the same weights.

For a tiny random Llama and Qwen2 (transformers, built here) and SmolLM2-135M-Instruct: the
adapters are PEFT's own files (random A and non-zero random B; rank, alpha, rslora and the
targeted modules vary), and each engine's logits with an adapter, at every step of a prefill
and greedy decode, match the PEFT model's float32 eager forward over the whole sequence
(no KV cache) within 1e-4 of the step's largest logit, match our own model with the adapter
merged into its weights, and the greedy tokens are the same. All adapters and the base model
run as rows of one batch, so every step also checks that rows on different adapters do not
disturb each other.

SmolLM2 comes as GGUF (Q4_1, llama with adjacent-pair RoPE): its dequantized float32 weights,
with q/k rows put back into Hugging Face's order, make the transformers model the adapter is
made on, so the comparison covers the loader's q/k row order for such models.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from parity.conftest import build_hf_model  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import EnginePlan  # noqa: E402
from llm_runner_svc.engines.batch import Batch, Row  # noqa: E402
from llm_runner_svc.models import Model, load_model  # noqa: E402
from llm_runner_svc.models.lora import MODULES, LoraAdapter, load_adapter, merge_adapter  # noqa: E402
from llm_runner_svc.models.spec import ModelWeights  # noqa: E402

peft = pytest.importorskip("peft")

RTOL = 1e-4
PROMPT_LEN = 10
DECODE_STEPS = 8
ENGINES = ["numpy", "torch"]
# (rank, alpha, rslora, targets) of the adapters made per model
ADAPTERS = [(8, 16, False, tuple(MODULES)),
            (4, 8, True, ("q_proj", "v_proj")),
            (6, 12, False, ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))]


def make_peft_adapter(tm: Any, path: Path, seed: int, rank: int, alpha: float, rslora: bool,
                      targets: tuple[str, ...], std: float) -> Any:
    """A PEFT model over a copy of `tm` whose A and B are random (B non-zero: PEFT starts it
    at zero), saved as PEFT saves adapters; returns the PEFT model in eval mode."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                             target_modules=list(targets), lora_dropout=0.0)
    pm = peft.get_peft_model(copy.deepcopy(tm), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(str(path))
    return pm.eval()


def _reference_logits(tm: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = tm(input_ids=torch.tensor([ids]), use_cache=False).logits
    return out[0, -1].to(torch.float32).numpy()


def _check(ours: np.ndarray, theirs: np.ndarray, what: str) -> float:
    scale = float(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=RTOL * scale, err_msg=what)
    return float(np.abs(ours - theirs).max()) / scale


def run_rows(model: Model, engine_name: str, weights: ModelWeights,
             adapters: list[LoraAdapter], prompt: list[int], routes: list[int],
             steps: int) -> tuple[list[list[np.ndarray]], list[list[int]]]:
    """Greedy generation of `prompt` once per entry of `routes` (row i on adapter
    routes[i], 0 = base), all rows in one batch per step; per row, the logits of every step
    and its tokens."""
    options = {"adapters": adapters} if adapters else {}
    if engine_name == "torch":
        options["device"] = "cpu"
    eng = create_engine(engine_name, model.config, weights, **options)
    page = 8
    per_row = -(-(len(prompt) + steps + 1) // page)
    n = len(routes)
    eng.preallocate(EnginePlan(max_batch=n, max_seq=per_row * page, page_size=page,
                               num_pages=n * per_row, prefill_chunk=n * len(prompt)))
    # non-contiguous pages per row
    tables = [tuple(r + n * j for j in reversed(range(per_row))) for r in range(n)]
    rows = [Row(tuple(prompt), 0, tables[r], adapter=k) for r, k in enumerate(routes)]
    logits: list[list[np.ndarray]] = [[] for _ in routes]
    tokens: list[list[int]] = [[] for _ in routes]
    for step in range(steps + 1):
        eng.read(eng.launch(Batch(tuple(rows), keep_logits=True)))
        got = np.array(eng.logits(n), dtype=np.float32)
        for r in range(n):
            logits[r].append(got[r])
            tokens[r].append(int(np.argmax(got[r])))
        pos = len(prompt) + step
        rows = [Row((tokens[r][-1],), pos, tables[r], adapter=k)
                for r, k in enumerate(routes)]
    eng.close()
    return logits, tokens


def check_against_peft(model: Model, peft_models: list[Any], base_model: Any,
                       adapters: list[LoraAdapter], engine_name: str, seed: int) -> float:
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(3, model.config.vocab_size, PROMPT_LEN)]
    routes = [1, 0, *range(2, len(adapters) + 1)]
    logits, tokens = run_rows(model, engine_name, model.weights, adapters, prompt, routes,
                              DECODE_STEPS)
    worst = 0.0
    for r, k in enumerate(routes):
        ref_model = peft_models[k - 1] if k else base_model
        ids = list(prompt)
        for step in range(DECODE_STEPS + 1):
            ref = _reference_logits(ref_model, ids)
            worst = max(worst, _check(logits[r][step], ref, f"adapter {k}, step {step}"))
            assert tokens[r][step] == int(np.argmax(ref)), f"adapter {k}, step {step}"
            ids.append(tokens[r][step])
        if k:
            merged = merge_adapter(model.weights, adapters[k - 1])
            m_logits, m_tokens = run_rows(model, engine_name, merged, [], prompt, [0],
                                          DECODE_STEPS)
            assert m_tokens[0] == tokens[r], f"adapter {k}: merged model's tokens"
            for step in range(DECODE_STEPS + 1):
                _check(logits[r][step], m_logits[0][step], f"merged {k}, step {step}")
    base_tokens = tokens[routes.index(0)]
    assert all(tokens[r] != base_tokens for r, k in enumerate(routes) if k)
    return worst


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory) -> tuple[Model, Any, list[Any], list[LoraAdapter]]:
    arch = request.param
    root = tmp_path_factory.mktemp(f"peft-{arch}")
    tm = build_hf_model(arch, root / "model")
    model = load_model(root / "model")
    peft_models, adapters = [], []
    for i, (rank, alpha, rslora, targets) in enumerate(ADAPTERS):
        path = root / f"a{i}"
        peft_models.append(make_peft_adapter(tm, path, 100 + i, rank, alpha, rslora,
                                             targets, std=0.2))
        adapters.append(load_adapter(f"a{i}", path, model.config))
    return model, tm, peft_models, adapters


@pytest.mark.parametrize("engine", ENGINES)
def test_tiny_models_match_peft(tiny, engine: str) -> None:
    model, tm, peft_models, adapters = tiny
    worst = check_against_peft(model, peft_models, tm, adapters, engine, seed=7)
    print(f"{model.config.arch} {engine}: worst |diff| / max|logit| = {worst:.2e}")


def hf_from_gguf_llama(model: Model) -> Any:
    """The transformers Llama holding a GGUF llama model's (dequantized) weights, q and k
    rows put back from adjacent RoPE pairs into Hugging Face's halves order."""
    c, w = model.config, model.weights
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position,
        rms_norm_eps=c.rms_eps, rope_theta=c.rope_theta, tie_word_embeddings=True,
        attn_implementation="eager")
    tm = transformers.LlamaForCausalLM(config).to(torch.float32).eval()

    def halves(m: np.ndarray, heads: int) -> torch.Tensor:
        out, inp = m.shape
        return torch.from_numpy(np.ascontiguousarray(
            m.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)))

    sd = {"model.embed_tokens.weight": torch.from_numpy(w.embedding),
          "model.norm.weight": torch.from_numpy(w.final_norm)}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": torch.from_numpy(lw.attn_norm),
               p + "post_attention_layernorm.weight": torch.from_numpy(lw.ffn_norm),
               p + "self_attn.q_proj.weight": halves(lw.wq, c.num_heads),
               p + "self_attn.k_proj.weight": halves(lw.wk, c.num_kv_heads),
               p + "self_attn.v_proj.weight": torch.from_numpy(lw.wv),
               p + "self_attn.o_proj.weight": torch.from_numpy(lw.wo),
               p + "mlp.gate_proj.weight": torch.from_numpy(lw.w_gate),
               p + "mlp.up_proj.weight": torch.from_numpy(lw.w_up),
               p + "mlp.down_proj.weight": torch.from_numpy(lw.w_down)}
    missing, unexpected = tm.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tm.tie_weights()
    return tm


@pytest.mark.parametrize("engine", ENGINES)
def test_smollm2_matches_peft(engine: str, tmp_path: Path) -> None:
    model = load_model("smollm2")
    assert model.config.tie_embeddings and model.weights.lm_head is None
    tm = hf_from_gguf_llama(model)
    peft_models, adapters = [], []
    for i, (rank, alpha, rslora, targets) in enumerate(ADAPTERS[:2]):
        path = tmp_path / f"a{i}"
        peft_models.append(make_peft_adapter(tm, path, 200 + i, rank, alpha, rslora, targets,
                                             std=0.05))
        adapters.append(load_adapter(f"a{i}", path, model.config))
    worst = check_against_peft(model, peft_models, tm, adapters, engine, seed=11)
    print(f"smollm2 {engine}: worst |diff| / max|logit| = {worst:.2e}")
