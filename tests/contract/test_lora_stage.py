"""LoRA adapters over gRPC: Describe lists them, a cohort mixing adapters and the base model
gives each member the tokens of its adapter merged into the model, Diagnostics names the
adapter, and Admit refuses a name the stage does not serve."""

from __future__ import annotations

import pytest
from google.protobuf.json_format import MessageToDict
from helpers import TEST_ENGINE
from lora_fixtures import write_adapter
from stage_harness import StageServer

from llm_runner_svc.engines import create_engine
from llm_runner_svc.models.lora import load_adapter, merge_adapter
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve
from llm_runner_svc.stage.config import StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb

TEXT = "Once upon a time"


def _merged_tokens(stories, adapter_dir, n: int) -> list[int]:
    weights = stories.weights
    if adapter_dir is not None:
        weights = merge_adapter(weights, load_adapter("x", adapter_dir, stories.config))
    rt = InferenceRuntime(create_engine("numpy", stories.config, weights), stories.tokenizer,
                          RuntimeConfig(max_batch=1, max_seq=256))
    rt.preallocate()
    ids = stories.tokenizer.encode(TEXT, add_bos=stories.tokenizer.default_add_bos())
    req = GenerationRequest("m", ids, resolve(rt.config.sampling, temperature=0.0,
                                              max_new_tokens=n), ignore_eos=True)
    tokens = [t for ev in rt.generate(req) for t in ev.token_ids]
    rt.close()
    return tokens


def test_a_cohort_mixing_adapters(stories, tmp_path):
    if TEST_ENGINE not in ("numpy", "torch"):
        pytest.skip(f"the {TEST_ENGINE} engine serves no LoRA adapters")
    dirs = {n: write_adapter(tmp_path / n, stories.config, seed=i)
            for i, n in enumerate(("fr", "de"))}
    config = StageConfig(max_seq=256, lora_adapters=tuple((n, str(p)) for n, p in dirs.items()))
    with StageServer(config) as srv:
        assert list(srv.stub.Describe(pb.DescribeRequest()).lora_adapters) == ["fr", "de"]
        refused = srv.admit(9, text=TEXT, lora="es")
        assert not refused.admitted and refused.refusal == pb.REFUSAL_UNKNOWN_ADAPTER
        assert "['fr', 'de']" in refused.reason
        names = {0: "fr", 1: "", 2: "de", 3: "fr"}
        for sid, name in names.items():
            srv.admit_prepare(sid, text=TEXT, lora=name, temperature=0.0, max_tokens=12,
                              ignore_eos=True)
        stream = srv.step(list(names), credits=64)
        got = stream.collect(set(names))
        stream.half_close()
        for sid, name in names.items():
            want = _merged_tokens(stories, dirs.get(name), 12)
            assert got[sid]["tokens"] == want, name
            srv.stub.Finish(pb.FinishRequest(slot_id=sid))
            diag = MessageToDict(srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)).values)
            assert diag["adapter"] == name
            srv.stub.Reset(pb.ResetRequest(slot_id=sid))
        assert got[0]["tokens"] != got[1]["tokens"] != got[2]["tokens"]
        registry = srv.stage.metrics.registry
        for name, n in (("fr", 2), ("de", 1), ("base", 1)):
            assert registry.get_sample_value("llmstage_adapter_requests_total",
                                             {"adapter": name}) == n
