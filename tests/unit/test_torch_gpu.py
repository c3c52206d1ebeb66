"""The torch engine on a CUDA GPU (CUDA graphs, Triton kernels) against the references.

float32 on the GPU must give the numpy engine's greedy tokens and hidden states within 1e-5.
bf16 is checked against the numpy engine running the same weights, that is the float32
checkpoint rounded to bf16 as the GPU holds it (norm weights stay float32 on both), and
teacher-forced: both engines are fed the same tokens (the prompt, then the reference's greedy
continuation, one decode step at a time), so a near-tie that flips one token cannot send the
two runs down different texts. Where the reference's top-1 logit leads the top-2 by more than
BF16_MARGIN, the argmax must agree. Hidden states are compared two ways (relative: the whole
window, the median and the worst position):
- from the same cache: every call starts from the GPU's KV pool on both engines, including
  that call's own keys and values, so only the engines' arithmetic separates them; the fused
  products keep activations in float32, and the states agree to BF16_SAME_CACHE.
- end to end, each engine on its own cache: where the two float32 keys or values land on
  either side of a bf16 rounding boundary, the stored values differ by a whole bf16 step
  (2^-8), and later layers and positions carry that on. How far this goes depends on depth
  and prompt, not on the GPU: the printed "own spread" is the numpy engine against itself
  with the same tokens prefilled at once (another float32 summation order, same bf16 cache).
  BF16_END_TO_END bounds it.
The figures, and how far bf16 weights move the states from the float32 checkpoint, are
printed. Decode batches above `fused_rows` (and the largest matrices) multiply on cuBLAS in
bf16, which `test_cublas_products_against_the_same_weights` checks to that rounding.
The decode step must not move torch.cuda.memory_allocated() (nor its peak) across 1,000
steps. Prefill batches longer than `fused_prefill_rows` multiply on cuBLAS in bf16 and
attend in bf16: checked against the float32-activation path at several prompt lengths,
whole and chunked, and chunks of several requests in one forward against solo prefills.
These tests need a GPU; CI has none, and benchmarks/gpu_run.sh runs them on one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import drain  # noqa: E402
from parity.conftest import build_hf_model  # noqa: E402
from test_torch_engine import prefill_batch_against_solo  # noqa: E402

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import DecodeRow, EnginePlan  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_MARGIN = 0.05  # logits: a lead no KV rounding can overturn
# (window, median, worst position). H200, 2026-12-04, the five models: from the same cache
# 2.1e-6 to 8.6e-6 / 1.8e-6 to 5.0e-6 / 7.4e-6 to 4.9e-5; end to end 1.1e-4 to 2.8e-3 /
# 7.8e-5 to 2.0e-3 / 3.9e-4 to 7.4e-3, the largest on SmolLM2's 30 layers.
BF16_SAME_CACHE = (5e-5, 5e-5, 2e-4)
BF16_END_TO_END = (5e-3, 5e-3, 1.5e-2)
# With bf16 activations into every product (cuBLAS), a dozen bf16 roundings (2^-8 each) at
# the worst position: 2.8e-2 to 3.5e-2 from float32 measured on the H200 (2026-12-03).
BF16_CUBLAS_REL = 5e-2


def bf16_weights(model):
    """`model` with every matrix and bias rounded to bf16 (kept float32 on the host)."""
    def rnd(a):
        if a is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).float().numpy()

    mats = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "bq", "bk", "bv")
    w = model.weights
    layers = [dataclasses.replace(lw, **{k: rnd(getattr(lw, k)) for k in mats})
              for lw in w.layers]
    weights = dataclasses.replace(w, embedding=rnd(w.embedding), lm_head=rnd(w.lm_head),
                                  layers=layers)
    return dataclasses.replace(model, weights=weights)


def _run(model, prompt: list[int], max_new: int, engine: str = "torch", **options):
    """Greedy tokens, text and stacked hidden states of one request; `options` holds the
    engine's (dtype, kernels) and the runtime's settings."""
    eng_keys = {k: options.pop(k) for k in ("dtype", "kernels") if k in options}
    if engine == "torch":
        eng_keys["device"] = "cuda"
    rt = InferenceRuntime(create_engine(engine, model.config, model.weights, **eng_keys),
                          model.tokenizer, RuntimeConfig(**options))
    rt.preallocate()
    req = GenerationRequest("g", prompt, resolve(rt.config.sampling, temperature=0.0,
                                                 max_new_tokens=max_new),
                            capture_hidden=rt.plan.hidden_layer is not None)
    tokens, text, hidden = [], "", []
    for ev in rt.generate(req):
        tokens += ev.token_ids
        text += ev.text
        hidden += ev.hidden
    rt.close()
    states = np.concatenate([h.states for h in hidden]) if hidden else None
    return tokens, text, states


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


PAGE = 16  # KV page size of the teacher-forced runs


def _one_request(eng, n: int, prefill_chunk: int = 256) -> list[int]:
    """Preallocate `eng` for one request of `n` positions; returns its page table."""
    table = list(range((n + PAGE - 1) // PAGE))
    eng.preallocate(EnginePlan(max_batch=1, max_seq=n, page_size=PAGE, num_pages=len(table),
                               prefill_chunk=prefill_chunk, hidden_layer=-1))
    return table


def _clear_leads_agree(got: np.ndarray, want: np.ndarray, margin: float) -> np.ndarray:
    """Per row of logits: where `want`'s top-1 leads its top-2 by more than `margin`; asserts
    `got` picks the same token there."""
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > margin
    assert (got.argmax(1) == want.argmax(1))[clear].all()
    return clear


def _teacher_forced(model, engine: str, prompt: list[int], follow: list[int], **opts):
    """[len(follow), vocab] logits and [len(prompt) + len(follow) - 1, hidden] states: the
    prompt prefilled, then every token of `follow` but the last decoded one step at a time."""
    eng = create_engine(engine, model.config, model.weights, **opts)
    table = _one_request(eng, len(prompt) + len(follow))
    states = [eng.prefill(prompt, 0, table, capture_hidden=True).states]
    logits = [eng.logits(1)[0].copy()]
    for i, tok in enumerate(follow[:-1]):
        (hs,) = eng.decode([DecodeRow(tok, len(prompt) + i, table, capture_hidden=True)])
        states.append(hs.states)
        logits.append(eng.logits(1)[0].copy())
    eng.close()
    return np.stack(logits), np.concatenate(states).astype(np.float32)


def _prefilled_at_once(model, seq: list[int], **opts) -> np.ndarray:
    """States of `seq` but its last token, prefilled in one call on the numpy engine: the
    same float32 arithmetic as `_teacher_forced` summed in another order."""
    eng = create_engine("numpy", model.config, model.weights, **opts)
    table = _one_request(eng, len(seq), prefill_chunk=len(seq))
    states = eng.prefill(seq[:-1], 0, table, capture_hidden=True).states
    eng.close()
    return np.asarray(states, np.float32)


def _from_the_same_cache(model, same, prompt: list[int], follow: list[int], chunk: int = 8):
    """Teacher-forced like `_teacher_forced`, the prompt prefilled `chunk` tokens at a time,
    each call made by the GPU (bf16) first and then by the numpy engine (`same` weights) on
    the GPU's KV pool: copied into numpy's (bf16 values, exact in float32) with this call's
    own keys and values, which numpy then reads instead of storing its own. Both engines see
    the same cache at every layer, so what is left between them is their float32 arithmetic,
    not where a bf16 store rounds. Returns (GPU, numpy) pairs of [calls, vocab] logits and
    [positions, hidden] states."""
    gpu = create_engine("torch", model.config, model.weights, device="cuda",
                        dtype="bfloat16")
    ref = create_engine("numpy", same.config, same.weights)
    ref._store_kv = lambda layer, slots, kv: None  # the GPU's pool holds them already
    n, kv = len(prompt) + len(follow), model.config.kv_dim
    table = _one_request(gpu, n, prefill_chunk=chunk)
    _one_request(ref, n, prefill_chunk=chunk)
    rows = len(table) * PAGE
    calls = [(prompt[lo:lo + chunk], lo) for lo in range(0, len(prompt), chunk)]
    calls += [([tok], len(prompt) + i) for i, tok in enumerate(follow[:-1])]
    out: tuple[list, list, list, list] = ([], [], [], [])
    for ids, pos in calls:
        for eng, (logits, states) in ((gpu, out[:2]), (ref, out[2:])):
            if eng is ref:
                pool = ref._kv_pool  # [layers, rows, k | v]
                pool[:, :, :kv] = gpu.state.k_pool[:, :rows].float().cpu().numpy()
                pool[:, :, kv:] = gpu.state.v_pool[:, :rows].float().cpu().numpy()
            if len(ids) == 1 and pos >= len(prompt):
                (hs,) = eng.decode([DecodeRow(ids[0], pos, table, capture_hidden=True)])
            else:
                hs = eng.prefill(ids, pos, table, capture_hidden=True)
            states.append(np.asarray(hs.states, np.float32))
            logits.append(np.asarray(eng.logits(1)[0], np.float32).copy())
    gpu.close()
    ref.close()
    return tuple(np.concatenate(a) if i % 2 else np.stack(a) for i, a in enumerate(out))


def _spread(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """`a` relative to `b`: the whole window, the median and the worst position."""
    rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
    return _rel(a, b), float(np.median(rel)), float(rel.max())


def _fmt(spread: tuple[float, ...]) -> str:
    return " / ".join(f"{v:.1e}" for v in spread)


def _agree(got: np.ndarray, want: np.ndarray) -> str:
    return f"{int((got.argmax(1) == want.argmax(1)).sum())}/{len(want)}"


def _check(model, prompt: list[int], max_new: int, dtype: str, **cfg) -> list[int]:
    """The checks of the module docstring for one dtype; returns the GPU's tokens."""
    ref_tokens, _, ref_states = _run(model, prompt, max_new, engine="numpy", **cfg)
    if dtype == "float32":
        tokens, _, states = _run(model, prompt, max_new, dtype=dtype, **cfg)
        assert tokens == ref_tokens
        if states is not None:
            assert _rel(states, ref_states) < 1e-5
        return tokens
    same = bf16_weights(model)
    _, f32_h = _teacher_forced(model, "numpy", prompt, ref_tokens)
    ref_logits, ref_h = _teacher_forced(same, "numpy", prompt, ref_tokens,
                                      kv_dtype="bfloat16")
    logits, h = _teacher_forced(model, "torch", prompt, ref_tokens, device="cuda",
                                dtype="bfloat16")
    own = _spread(ref_h, _prefilled_at_once(same, prompt + ref_tokens, kv_dtype="bfloat16"))
    ends = _spread(h, ref_h)
    moved = _spread(h, f32_h)
    s_logits, s_h, s_ref_logits, s_ref_h = _from_the_same_cache(model, same, prompt, ref_tokens)
    steps = _spread(s_h, s_ref_h)
    print(f"{model.name} bf16 over {len(ref_tokens)} steps, states relative (window / median "
          f"/ worst position) to the same weights on numpy: from the same cache "
          f"{_fmt(steps)}; teacher-forced end to end {_fmt(ends)}, the reference's own "
          f"spread {_fmt(own)}; argmax equal {_agree(s_logits, s_ref_logits)} and "
          f"{_agree(logits, ref_logits)}; vs the float32 checkpoint {_fmt(moved)}")
    _clear_leads_agree(s_logits, s_ref_logits, BF16_MARGIN)
    _clear_leads_agree(logits, ref_logits, BF16_MARGIN)
    assert all(a < b for a, b in zip(steps, BF16_SAME_CACHE, strict=True))
    assert all(a < b for a, b in zip(ends, BF16_END_TO_END, strict=True))
    return ref_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stories_goldens_on_gpu(stories, goldens, dtype):
    bos = next(c for c in goldens["cases"] if c["name"] == "greedy_from_bos")
    tokens = _check(stories, bos["prompt_token_ids"], bos["steps"], dtype, max_batch=4,
                    max_seq=512)
    if dtype == "float32":
        assert tokens == bos["generated_token_ids"]
    dragon = next(c for c in goldens["cases"] if c["name"] == "greedy_dragon")
    ids = stories.tokenizer.encode(dragon["prompt"])
    _, text, _ = _run(stories, ids, dragon["steps"] - len(ids) + 1, dtype="float32",
                      max_batch=4, max_seq=512)
    assert dragon["prompt"] + text == dragon["text"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_hf_configs_on_gpu(arch, dtype, tmp_path):
    build_hf_model(arch, tmp_path / arch, seed=3)
    model = load_model(tmp_path / arch)
    _check(model, [5, 17, 99, 42, 7, 250, 31, 8, 64, 12], 40, dtype, max_batch=2,
           max_seq=128, hidden_layer=-1, page_size=4, prefill_chunk=8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_on_gpu(dtype):
    model = load_model("smollm2")
    prompt = model.tokenizer.encode(model.chat_template.render(
        [{"role": "user", "content": "Write one sentence about the sea."}]), add_bos=False)
    _check(model, prompt, 40, dtype, max_batch=2, max_seq=256, hidden_layer=-1)


def _batch_tokens(model, engine: str, solo: bool = False, **opts) -> dict:
    """Greedy outputs of six requests of different lengths decoding together in a batch of
    4, rows joining and leaving (or each alone, `solo`)."""
    eng = create_engine(engine, model.config, model.weights, **opts)
    rt = InferenceRuntime(eng, model.tokenizer, RuntimeConfig(max_batch=4, max_seq=512))
    rt.preallocate()
    reqs = [GenerationRequest(f"r{i}", [1] + [300 + i] * (1 + 40 * i), resolve(
        rt.config.sampling, temperature=0.0, max_new_tokens=60 + 10 * i)) for i in range(6)]
    out: dict = {}
    if solo:
        for req in reqs:
            out[req.request_id] = [t for ev in rt.generate(req) for t in ev.token_ids]
    else:
        for req in reqs:
            rt.submit(req)
        out = drain(rt)
    rt.close()
    return out


def test_fused_batches_match_solo_runs(stories):
    """The fused products in CUDA graphs with rows joining and leaving batches of 1 to 4,
    prompts prefilling beside decodes and beside each other, give every request the tokens
    it gets alone: with every product on the fused kernels (whose rows do not depend on
    their batch mates, unlike cuBLAS's choice of kernel by batch size), a request's numbers
    do not depend on what shares its steps."""
    opts = dict(device="cuda", fused_rows=4, fused_prefill_rows=256)
    assert _batch_tokens(stories, "torch", **opts) == _batch_tokens(stories, "torch",
                                                                     solo=True, **opts)


def test_cublas_products_against_the_same_weights(stories):
    """Decode batches above `fused_rows` (here every one) multiply on cuBLAS, the
    activations rounded to bf16: teacher-forced against the numpy engine on the same weights,
    the argmax agrees wherever the lead is clear of that rounding and states stay within
    BF16_CUBLAS_REL."""
    same = bf16_weights(stories)
    follow, _, _ = _run(same, [1], 120, engine="numpy", max_batch=1, max_seq=256)
    ref_logits, ref_h = _teacher_forced(same, "numpy", [1], follow, kv_dtype="bfloat16")
    logits, h = _teacher_forced(stories, "torch", [1], follow, device="cuda", fused_rows=0)
    _, median, worst = _spread(h, ref_h)
    print(f"cuBLAS products: states rel max {worst:.1e} median {median:.1e}")
    clear = _clear_leads_agree(logits, ref_logits, 0.5)
    print(f"cuBLAS products: clear leads {clear.sum()}/{len(clear)}")
    assert worst < BF16_CUBLAS_REL


def test_decode_steps_do_not_allocate(stories):
    config = dataclasses.replace(stories.config, max_position=2048)
    eng = create_engine("torch", config, stories.weights, device="cuda")
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(max_batch=8, max_seq=1200))
    rt.preallocate()
    for i in range(8):
        rt.submit(GenerationRequest(f"r{i}", [1, 300 + i], resolve(
            rt.config.sampling, temperature=0.0, max_new_tokens=1100), ignore_eos=True))
    for _ in range(20):
        rt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(1000):
        assert len(rt.step()) == 8
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.max_memory_allocated() == before
    rt.close()


def test_prefill_batch_matches_solo_prefills_on_gpu(stories):
    """Chunks of three requests in one forward give each request its solo prefill's logits
    and states, on the float32-activation path (windows up to `fused_prefill_rows`) and on
    the bf16 cuBLAS path (`fused_prefill_rows=0`), where only cuBLAS's choice of kernel by
    batch size separates the two."""
    for rows, tol in ((64, 1e-5), (0, BF16_CUBLAS_REL)):
        for (logits, states), (want_logits, want_states) in prefill_batch_against_solo(
                stories, device="cuda", fused_prefill_rows=rows):
            _, _, worst = _spread(states, want_states)
            print(f"prefill batch vs solo, fused_prefill_rows {rows}: worst position "
                  f"{worst:.1e}, logits {np.abs(logits - want_logits).max():.1e}")
            assert worst < tol
            _clear_leads_agree(logits[None], want_logits[None], 0.5)


def _prefill_states(model, prompt: list[int], chunk: int, rows: int, **opts):
    """Logits [1, vocab] and states [len, hidden] of `prompt` prefilled on the GPU (bf16) in
    chunks of `chunk`, with prefill batches of up to `rows` tokens on the fused products."""
    eng = create_engine("torch", model.config, model.weights, device="cuda",
                        fused_prefill_rows=rows, **opts)
    table = _one_request(eng, len(prompt), prefill_chunk=chunk)
    states = eng.prefill(prompt, 0, table, capture_hidden=True).states
    logits = eng.logits(1).copy()
    eng.close()
    return logits, np.asarray(states, np.float32)


@pytest.mark.parametrize("arch", ["stories", "qwen3"])
def test_fast_prefill_against_the_precise_path(arch, stories, tmp_path):
    """Long prefill windows (bf16 cuBLAS products and bf16 attention over the pages) against
    the float32-activation path that the parity tests hold to the numpy engine, for several
    prompt lengths, in one call and in chunks that start past earlier ones: states within
    bf16 rounding (BF16_CUBLAS_REL), the same argmax wherever its lead is clear of it."""
    if arch == "stories":
        model, lengths = stories, (100, 300, 511)
    else:
        build_hf_model(arch, tmp_path / arch, seed=3)
        model, lengths = load_model(tmp_path / arch), (100, 255)
    gen = np.random.default_rng(0)
    for n in lengths:
        prompt = [int(t) for t in gen.integers(3, model.config.vocab_size, n)]
        want_logits, want = _prefill_states(model, prompt, chunk=n, rows=n)
        for chunk in (n, 96):
            logits, got = _prefill_states(model, prompt, chunk=chunk, rows=0)
            spread = _spread(got, want)
            print(f"{arch} fast prefill of {n} in chunks of {chunk}: states {_fmt(spread)}, "
                  f"logits {np.abs(logits - want_logits).max():.1e}")
            assert spread[2] < BF16_CUBLAS_REL
            _clear_leads_agree(logits, want_logits, 0.5)


@pytest.mark.parametrize("split, norm_inside, evict", [(1, True, 0), (2, True, 0),
                                                      (2, False, 1)])
def test_short_products_against_the_precise_path(stories, split, norm_inside, evict,
                                                  monkeypatch):
    """Prefill passes of up to 64 tokens on the short products (torch_triton_short.py:
    the norms inside q/k/v and gate/up or before them, the SiLU gate and the residual sums
    inside; split K ranges summed by the last program; the weights' loads with and
    without the eviction hint), chunks of 50 and of 7 after earlier
    ones: states within bf16 rounding of the float32-activation path (BF16_CUBLAS_REL) and
    of the same passes on cuBLAS, the same argmax wherever its lead is clear of it."""
    from llm_runner_svc.engines.torch_triton_modes import ACCUMULATE, SILU_GATE, STORE, Tiling
    from llm_runner_svc.engines.torch_triton_short import ShortProducts

    c = stories.config
    shapes = [(c.q_dim + 2 * c.kv_dim, c.hidden_size, STORE, norm_inside),
              (c.hidden_size, c.q_dim, ACCUMULATE, False),
              (c.intermediate_size, c.hidden_size, SILU_GATE, norm_inside),
              (c.hidden_size, c.intermediate_size, ACCUMULATE, False)]
    tilings = dict.fromkeys(shapes, Tiling(16, 32, split, 4, 3, evict))
    launches = []
    launch = ShortProducts._launch
    monkeypatch.setattr(ShortProducts, "_launch", lambda self, *a, **k: launches.append(
        launch(self, *a, **k)) or launches[-1])
    gen = np.random.default_rng(2)
    prompt = [int(t) for t in gen.integers(3, c.vocab_size, 300)]
    want_logits, want = _prefill_states(stories, prompt, chunk=300, rows=300)
    for chunk in (50, 7):
        launches.clear()
        logits, got = _prefill_states(stories, prompt, chunk=chunk, rows=0,
                                      short_prefill_rows=64, short_tilings=tilings)
        # every product of every pass (and of the graphs captured at preallocate)
        assert sum(launches) >= 4 * c.num_layers * -(-300 // chunk)
        cublas_logits, cublas = _prefill_states(stories, prompt, chunk=chunk, rows=0,
                                                short_prefill_rows=0)
        spread, apart = _spread(got, want), _spread(got, cublas)
        print(f"short products (split {split}, norm inside {norm_inside}, evict {evict}) in "
              f"chunks of {chunk}: states {_fmt(spread)} from the precise path, {_fmt(apart)} from "
              "cuBLAS")
        assert spread[2] < BF16_CUBLAS_REL
        assert apart[2] < BF16_CUBLAS_REL
        _clear_leads_agree(logits, want_logits, 0.5)
        _clear_leads_agree(logits, cublas_logits, 0.5)


@pytest.mark.parametrize("mode", ["bf16", "split", "ieee"])
def test_split_prefill_keys_against_one_program_per_block(mode):
    """A short pass after long prefixes (the cached-prompt case) spreads each query block's
    keys over several programs: the combined result equals a float64 reference as closely
    as one program per block does, in each operand mode, for chunks of a padded graph
    layout and of an exact one, including a chunk whose keys fit one split."""
    from llm_runner_svc.engines.torch_prefill import PrefillChunk, PrefillStager
    from llm_runner_svc.engines.torch_triton_prefill import (
        PrefillPartials,
        launch_prefill_attention,
        prefill_block,
        prefill_splits,
    )

    heads, kv_heads, hd, page, pages = 28, 4, 128, 16, 400
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(7)
    pool_dtype = torch.float32 if mode == "ieee" else torch.bfloat16
    q_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    k_pool = torch.randn(pages * page + page, kv_heads * hd, generator=gen).to(dev, pool_dtype)
    v_pool = torch.randn(pages * page + page, kv_heads * hd, generator=gen).to(dev, pool_dtype)
    order = torch.randperm(pages - 1, generator=gen).tolist()
    chunks = [PrefillChunk([0] * 50, 2000, order[:129], 0),
              PrefillChunk([0] * 9, 3, order[129:130], 1),
              PrefillChunk([0] * 5, 700, order[130:175], 2)]
    stager = PrefillStager(max_tokens=512, max_chunks=4, pages=200, page_size=page,
                           scratch_page=pages, device=dev)
    partials = PrefillPartials(heads, hd, torch.cuda.get_device_properties(0)
                               .multi_processor_count, dev)
    for pad in (0, 64):
        layout = stager.stage(chunks, prefill_block(64), pad_tokens=pad)
        n = layout.num_tokens
        assert prefill_splits(n, layout.block, heads, partials.num_sms) > 1
        qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=gen).to(dev, q_dtype)
        one = torch.zeros(n, heads * hd, device=dev, dtype=q_dtype)
        split = torch.zeros_like(one)
        args = (heads, kv_heads, hd, page, layout.block)
        launch_prefill_attention(qkv, k_pool, v_pool, layout.blocks, layout.tables, one, *args)
        launch_prefill_attention(qkv, k_pool, v_pool, layout.blocks, layout.tables, split,
                                 *args, partials=partials)
        for i, (first, count, start) in enumerate(layout.spans):
            end = start + count
            rows = (layout.tables[i, :(end - 1) // page + 1, None] * page
                    + torch.arange(page, device=dev)).reshape(-1)
            keys = k_pool[rows].double().view(-1, kv_heads, hd)
            vals = v_pool[rows].double().view(-1, kv_heads, hd)
            q = qkv[first:first + count, :heads * hd].double().view(count, heads, hd)
            q = q.transpose(0, 1)  # [heads, count, hd]
            kh = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
            vh = vals.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
            scores = q @ kh.transpose(1, 2) / hd ** 0.5
            pos = torch.arange(start, end, device=dev)
            hidden = torch.arange(kh.shape[1], device=dev)[None, :] > pos[:, None]
            want = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ vh
            want = want.transpose(0, 1).reshape(count, heads * hd)
            err_one = (one[first:first + count].double() - want).abs().max().item()
            err_split = (split[first:first + count].double() - want).abs().max().item()
            print(f"{mode} pad {pad} chunk {i} at {start}: one program {err_one:.1e}, "
                  f"split {err_split:.1e}")
            assert err_split <= max(2 * err_one, 1e-5)
