"""LoRA adapters: PEFT files load or are refused naming the file and rule; a batch mixing
adapters (and the base model) gives every request exactly the tokens it gets alone, which
are the tokens of the model with its adapter merged into the weights; prefix-cache pages are
never shared across adapters."""

from __future__ import annotations

import json

import numpy as np
import pytest
from lora_fixtures import write_adapter
from safetensors.numpy import load_file, save_file

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.engines.batch import Batch, Row
from llm_runner_svc.errors import InvalidArgument, ModelFormatError, NotFound
from llm_runner_svc.models.lora import load_adapter, merge_adapter
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.prefix_cache import PrefixCache

# torch-gather: decode rows add their adapters per row (the graph-safe path of CUDA, with
# torch products instead of the Triton kernels)
ENGINES = ["numpy", "torch", "torch-gather"]
TARGETS = [None, ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj")]
PROMPTS = [[1, 403, 407, 261, 378], [1, 70, 90, 33], [1, 365, 301, 271, 15, 8, 99, 44, 3],
           [1, 5], [1, 403, 407, 261, 378], [1, 70, 90, 33, 12, 19], [1, 9, 9, 9], [1, 88]]
ROUTES = [0, 1, 2, 3, 1, 2, 3, 0]  # 8 requests over 3 adapters and the base model


@pytest.fixture(scope="module")
def adapters(stories, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for i, targets in enumerate(TARGETS):
        kw = {"targets": targets} if targets else {}
        path = write_adapter(root / f"a{i}", stories.config, seed=10 + i, rslora=i == 2, **kw)
        out.append(load_adapter(f"a{i}", path, stories.config))
    return out


def _engine(stories, engine: str, weights=None, adapters=(), **options):
    if adapters:
        options["adapters"] = adapters
    eng = create_engine(engine.split("-")[0], stories.config, weights or stories.weights,
                        **options)
    if adapters and engine == "torch-gather":
        eng.reserve_adapters(len(adapters), kernel="gather")
    return eng


def _runtime(stories, engine: str, weights=None, adapters=(), **cfg) -> InferenceRuntime:
    eng = _engine(stories, engine, weights, adapters)
    rt = InferenceRuntime(eng, stories.tokenizer,
                          RuntimeConfig(max_seq=128, page_size=4, prefill_chunk=8, **cfg))
    rt.preallocate()
    return rt


def _run(rt: InferenceRuntime, jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    sampling = resolve(rt.config.sampling, temperature=0.0, max_new_tokens=16)
    for i, (ids, adapter) in enumerate(jobs):
        rt.submit(GenerationRequest(f"r{i}", ids, sampling, ignore_eos=True, adapter=adapter))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    while rt.has_work:
        for ev in rt.step():
            out[ev.request_id].extend(ev.token_ids)
    rt.close()
    return [out[f"r{i}"] for i in range(len(jobs))]


@pytest.mark.parametrize("engine", ENGINES)
def test_mixed_batch_matches_solo_and_merged(stories, adapters, engine):
    jobs = list(zip(PROMPTS, ROUTES, strict=True))
    mixed = _run(_runtime(stories, engine, adapters=adapters, max_batch=8), jobs)
    for (ids, k), tokens in zip(jobs, mixed, strict=True):
        alone = _run(_runtime(stories, engine, adapters=adapters, max_batch=1), [(ids, k)])
        assert tokens == alone[0], f"adapter {k}"
        weights = merge_adapter(stories.weights, adapters[k - 1]) if k else None
        merged = _run(_runtime(stories, engine, weights, max_batch=1), [(ids, 0)])
        assert tokens == merged[0], f"adapter {k}"
    base = {tuple(ids): t for (ids, k), t in zip(jobs, mixed, strict=True) if k == 0}
    assert base  # the adapters change what the model says
    for (ids, k), tokens in zip(jobs, mixed, strict=True):
        if k and tuple(ids) in base:
            assert tokens != base[tuple(ids)]


@pytest.mark.parametrize("engine", ENGINES)
def test_logits_match_the_merged_model(stories, adapters, engine):
    plan = EnginePlan(max_batch=4, max_seq=64, page_size=4, num_pages=64, prefill_chunk=16)
    ids = tuple(PROMPTS[2])
    pages = tuple(range(8 * 0, 8))
    eng = _engine(stories, engine, adapters=adapters)
    eng.preallocate(plan)
    rows = [Row(ids, 0, tuple(range(8 * k, 8 * k + 8)), adapter=k) for k in range(4)]
    eng.read(eng.launch(Batch(tuple(rows), keep_logits=True)))
    got = np.array(eng.logits(4), dtype=np.float32)
    eng.close()
    for k in range(4):
        weights = merge_adapter(stories.weights, adapters[k - 1]) if k else stories.weights
        ref_eng = _engine(stories, engine, weights)
        ref_eng.preallocate(plan)
        ref_eng.prefill(ids, 0, pages)
        ref = np.array(ref_eng.logits(1), dtype=np.float32)[0]
        ref_eng.close()
        assert np.abs(got[k] - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max()), k


@pytest.mark.parametrize("engine", ["torch", "torch-gather"])
def test_bf16_logits_near_the_float32_merged_model(stories, adapters, engine):
    """In bf16, a prompt's logits on each adapter against the float32 merged model, the
    truth: within 2.5 times what rounding the merged model to bf16 moves them (the adapter
    path rounds A, B and the shrink's result where a merged model rounds its weights once;
    the test adapters' terms outweigh stories260K's weights, so that rounding alone moves
    the logits by percents), and far nearer than the base model is."""
    plan = EnginePlan(max_batch=3, max_seq=64, page_size=4, num_pages=48, prefill_chunk=16)
    ids = tuple(PROMPTS[2])

    def logits(weights, dtype, adapter_rows):
        eng = _engine(stories, engine, weights, adapters if adapter_rows else (), dtype=dtype)
        eng.preallocate(plan)
        ks = adapter_rows or [0]
        rows = [Row(ids, 0, tuple(range(8 * i, 8 * i + 8)), adapter=k)
                for i, k in enumerate(ks)]
        eng.read(eng.launch(Batch(tuple(rows), keep_logits=True)))
        out = np.array(eng.logits(len(rows)), dtype=np.float32)
        eng.close()
        return out

    got = logits(None, "bfloat16", [1, 2, 3])
    base = logits(None, "float32", [])[0]
    for k in (1, 2, 3):
        merged = merge_adapter(stories.weights, adapters[k - 1])
        truth = logits(merged, "float32", [])[0]
        rounded = logits(merged, "bfloat16", [])[0]
        err = np.abs(got[k - 1] - truth).max() / np.abs(truth).max()
        rounding = np.abs(rounded - truth).max() / np.abs(truth).max()
        without = np.abs(base - truth).max() / np.abs(truth).max()
        assert err <= 2.5 * rounding + 1e-2 < without / 4, k


def test_unknown_adapter_index_is_refused(stories, adapters):
    rt = _runtime(stories, "numpy", adapters=adapters, max_batch=2)
    sampling = resolve(rt.config.sampling, temperature=0.0, max_new_tokens=4)
    err = rt.admission_error(GenerationRequest("x", [1, 2], sampling, adapter=4))
    assert isinstance(err, NotFound) and "holds 3" in str(err)
    rt.close()
    eng = create_engine("numpy", stories.config, stories.weights)
    eng.preallocate(EnginePlan(max_batch=1, max_seq=16, page_size=4, num_pages=4))
    with pytest.raises(InvalidArgument, match="adapter 1"):
        eng.launch(Batch((Row((1, 2), 0, (0,), adapter=1),)))


def test_prefix_pages_are_not_shared_across_adapters():
    pool = PagePool(16, 4)
    cache = PrefixCache(pool, "model")
    tokens = list(range(1, 14))
    pages = pool.allocate(3)
    names: list[bytes] = []
    cache.commit(tokens, pages, names, 12, launch=0, adapter=1)
    assert cache.match(tokens, 1, adapter=1)[0] == pages
    assert cache.match(tokens, 1, adapter=2)[0] == []
    assert cache.match(tokens, 1)[0] == []


def test_mixed_batch_with_prefix_cache_matches_solo(stories, adapters):
    shared = [1, 403, 407, 261, 378, 70, 90, 33, 12, 19, 5]
    jobs = [(shared, 0), (shared, 1), (shared, 2), (shared, 1)]
    rt = _runtime(stories, "numpy", adapters=adapters, max_batch=4, prefix_cache=True)
    first = _run(rt, jobs[:2])
    rt = _runtime(stories, "numpy", adapters=adapters, max_batch=4, prefix_cache=True)
    both = _run(rt, jobs)
    assert both[:2] == first and both[3] == both[1]
    assert len({tuple(t) for t in both[:3]}) == 3


def _corrupt(path, **changes):
    meta = json.loads((path / "adapter_config.json").read_text())
    meta.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(meta))


def test_bad_adapter_files_are_refused_naming_the_file(stories, tmp_path):
    cfg = stories.config
    with pytest.raises(NotFound, match="adapter_config.json"):
        load_adapter("x", tmp_path / "none", cfg)
    path = write_adapter(tmp_path / "a", cfg, seed=1)
    _corrupt(path, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ModelFormatError, match=r"adapter_config.json.*lm_head"):
        load_adapter("x", path, cfg)
    path = write_adapter(tmp_path / "b", cfg, seed=1, rank=4)
    _corrupt(path, r=8)  # rank does not match the tensors
    with pytest.raises(ModelFormatError, match=r"adapter_model.safetensors.*expected"):
        load_adapter("x", path, cfg)
    path = write_adapter(tmp_path / "c", cfg, seed=1, targets=("q_proj",))
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in tensors if "layers.1." in k and "lora_B" in k)
    del tensors[key]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(ModelFormatError, match="layer 1 q_proj lacks its lora_B"):
        load_adapter("x", path, cfg)
    (path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelFormatError, match="not a valid safetensors"):
        load_adapter("x", path, cfg)
    path = write_adapter(tmp_path / "d", cfg, seed=1)
    _corrupt(path, r=0)
    with pytest.raises(ModelFormatError, match="r must be a positive integer"):
        load_adapter("x", path, cfg)


def test_stage_loads_adapters_and_admit_refuses_unknown_names(stories, tmp_path):
    from llm_runner_svc.stage.admission import Refusal, Refused, check_request
    from llm_runner_svc.stage.config import StageConfig
    from llm_runner_svc.stage.llm_stage import LlmStage
    from llm_runner_svc.stage.request import StageRequest

    good = [(n, str(write_adapter(tmp_path / n, stories.config, seed=i)))
            for i, n in enumerate(("fr", "de"))]
    config = StageConfig(lora_adapters=tuple(good))
    stage = LlmStage.create(config)
    assert stage.runtime.engine.num_adapters == 2
    check_request(config, stories, 64, StageRequest("a", text="Hi", lora="de"), 0)
    with pytest.raises(Refused) as info:
        check_request(config, stories, 64, StageRequest("b", text="Hi", lora="es"), 0)
    assert info.value.refusal is Refusal.UNKNOWN_ADAPTER
    assert "'es'" in info.value.reason and "['fr', 'de']" in info.value.reason
    bad = write_adapter(tmp_path / "bad", stories.config, seed=3)
    _corrupt(bad, r=2)
    with pytest.raises(ModelFormatError, match=r"bad/adapter_model.safetensors"):
        LlmStage.create(StageConfig(lora_adapters=(*good, ("bad", str(bad)))))


def test_the_client_names_the_adapter():
    from llm_stage_client.types import build_generate_request

    assert build_generate_request(prompt="Hi", adapter="fr").request.lora == "fr"
    assert build_generate_request(prompt="Hi").request.lora == ""


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_llm_runner_generate_with_an_adapter(stories, tmp_path, capsys, engine):
    """`llm-runner generate --adapter DIR` prints the merged model's greedy text."""
    from llm_runner_svc.cli import main

    path = write_adapter(tmp_path / "a", stories.config, seed=5)
    prompt = "Once upon a time"
    args = ["generate", prompt, "--temperature", "0", "--max-tokens", "12", "--quiet",
            "--engine", engine]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--adapter", str(path)]) == 0
    got = capsys.readouterr().out
    merged = merge_adapter(stories.weights, load_adapter("a", path, stories.config))
    rt = _runtime(stories, "numpy", merged, max_batch=1)
    ids = stories.tokenizer.encode(prompt, add_bos=stories.tokenizer.default_add_bos())
    want = "".join(ev.text for ev in rt.generate(GenerationRequest(
        "m", ids, resolve(rt.config.sampling, temperature=0.0, max_new_tokens=12))))
    rt.close()
    assert got == prompt + want + "\n" != plain
