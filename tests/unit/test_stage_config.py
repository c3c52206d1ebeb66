"""The deployment file: every field read, and every broken rule refused naming its key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llm_runner_svc.engines import engine_names
from llm_runner_svc.errors import RunnerError
from llm_runner_svc.stage.config import ConfigError, StageConfig, load_stage_config
from llm_runner_svc.stage.visual_pruning import PruningConfig

BASE = {"id": "thinker", "runner": "llm.backbone", "artifact": "stories260K",
        "engine": "numpy", "emits": ["text", "tokens"], "inputs": ["request:text"],
        "maxBatch": 8, "maxSeq": 512,
        "config": {"temperature": 0.7, "accept_hidden_layer": -1}}


def _write(tmp_path: Path, doc: object, name: str = "stage.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def _stage(**changes: object) -> dict:
    stage = json.loads(json.dumps(BASE))
    for key, value in changes.items():
        stage[key] = value
    return stage


def _with_config(**cfg: object) -> dict:
    return _stage(config={**BASE["config"], **cfg})


def _raises(tmp_path: Path, stage: dict, stage_id: str | None = None) -> RunnerError:
    with pytest.raises(RunnerError) as info:
        load_stage_config(_write(tmp_path, {"stages": [stage]}), stage_id)
    return info.value


def test_valid_file_fills_every_field(tmp_path):
    cfg = load_stage_config(_write(tmp_path, {"stages": [_with_config(
        top_p=0.5, top_k=7, max_generate_length=33, accept_hidden_layer=3)]}))
    assert (cfg.stage_id, cfg.artifact, cfg.engine) == ("thinker", "stories260K", "numpy")
    assert cfg.emits == ("text", "tokens")
    assert cfg.inputs == ("request:text",)
    assert (cfg.max_batch, cfg.max_seq, cfg.accept_hidden_layer) == (8, 512, 3)
    s = cfg.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_generate_length) == (0.7, 0.5, 7, 33)


def test_relative_artifact_resolves_against_the_file_folder(tmp_path):
    sub = tmp_path / "deploy"
    sub.mkdir()
    cfg = load_stage_config(_write(sub, {"stages": [_stage(artifact="models/m")]}))
    assert Path(cfg.artifact) == sub / "models" / "m"


def test_checkpoint_is_joined_onto_the_artifact_dir(tmp_path):
    stage = _stage(artifact="models/m", config={"checkpoint": "model.gguf"})
    cfg = load_stage_config(_write(tmp_path, {"stages": [stage]}))
    assert Path(cfg.artifact) == tmp_path / "models" / "m" / "model.gguf"


def test_picks_the_only_backbone_stage(tmp_path):
    other = _stage(id="talker", runner="tts.vocoder")
    cfg = load_stage_config(_write(tmp_path, {"stages": [other, _stage(id="mine")]}))
    assert cfg.stage_id == "mine"


def test_two_backbones_need_a_stage_id(tmp_path):
    path = _write(tmp_path, {"stages": [_stage(id="a"), _stage(id="b", maxBatch=3)]})
    with pytest.raises(ConfigError) as info:
        load_stage_config(path)
    assert "--stage" in info.value.message
    assert info.value.code == "INVALID_ARGUMENT"
    cfg = load_stage_config(path, "b")
    assert (cfg.stage_id, cfg.max_batch) == ("b", 3)
    with pytest.raises(ConfigError) as info:
        load_stage_config(path, "zzz")
    assert "'zzz'" in info.value.message


@pytest.mark.parametrize("stage, key", [
    (_stage(bogus=1), "stages[0].bogus"),
    (_with_config(bogus=1), "config.bogus"),
    (_stage(maxBatch=0), "maxBatch"),
    (_stage(maxBatch="8"), "maxBatch"),
    (_stage(maxBatch=True), "maxBatch"),
    (_stage(maxSeq=-1), "maxSeq"),
    (_stage(maxTokensPerStep=-1), "maxTokensPerStep"),
    (_stage(maxTokensPerStep=1.5), "maxTokensPerStep"),
    (_stage(kvMemoryBytes=-1), "kvMemoryBytes"),
    (_stage(kvMemoryFraction=1.5), "kvMemoryFraction"),
    (_with_config(top_p=1.5), "config.top_p"),
    (_with_config(top_p="x"), "config.top_p"),
    (_with_config(temperature=-1), "config.temperature"),
    (_with_config(top_k=-1), "config.top_k"),
    (_with_config(max_generate_length=0), "config.max_generate_length"),
    (_with_config(accept_hidden_layer=0), "config.accept_hidden_layer"),
    (_with_config(accept_hidden_layer=-2), "config.accept_hidden_layer"),
    (_stage(emits=["audio"]), "emits"),
    (_stage(engine="nope"), "engine"),
    ({k: v for k, v in BASE.items() if k != "id"}, "id"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_values_are_invalid_argument_naming_the_key(tmp_path, stage, key):
    exc = _raises(tmp_path, stage)
    assert isinstance(exc, ConfigError)
    assert exc.code == "INVALID_ARGUMENT"
    assert key in exc.message


def test_unknown_engine_lists_the_valid_ones(tmp_path):
    exc = _raises(tmp_path, _stage(engine="nope"))
    assert "'nope'" in exc.message
    assert all(name in exc.message for name in engine_names())


@pytest.mark.parametrize("key, value", [
    ("spec_decode", {"draft_top_k": 4, "dspark_scheduler": "sps"}),
    ("visual_pruning", {"algorithm": "fastv", "reduction_ratio": 0.25}),
    ("ple", {"file": "ple.bin", "residency": "host", "cache_slots": 64}),
    ("runtime_cache", "c"),
    ("offload_embedding", True),
])
def test_keys_this_build_cannot_honour_are_unimplemented(tmp_path, key, value):
    exc = _raises(tmp_path, _with_config(**{key: value}))
    assert exc.code == "UNIMPLEMENTED"
    assert f"config.{key}" in exc.message


def test_multimodal_keys_are_read(tmp_path):
    (tmp_path / "m").mkdir()
    stage = _with_config(multimodal_artifact="../vision", visual_pruning={
        "algorithm": "dart", "reduction_ratio": 0.25, "min_visual_tokens": 3,
        "pivot_image_tokens": 2, "pivot_text_tokens": 0},
        context_cache={"encoder_cache_budget_bytes": 1 << 20})
    stage["artifact"] = "m"
    cfg = load_stage_config(_write(tmp_path, {"stages": [stage]}))
    assert cfg.multimodal_artifact == str(tmp_path / "m" / "../vision")
    assert cfg.encoder_cache_bytes == 1 << 20
    assert cfg.visual_pruning == PruningConfig(0.25, 3, 2, 0)


def test_lora_adapter_paths_are_relative_to_the_artifact(tmp_path):
    (tmp_path / "m").mkdir()
    stage = _with_config(lora_adapters={"fr": "ad/fr", "de": "/abs/de"})
    stage["artifact"] = "m"
    cfg = load_stage_config(_write(tmp_path, {"stages": [stage]}))
    assert cfg.lora_adapters == (("fr", str(tmp_path / "m" / "ad/fr")), ("de", "/abs/de"))
    stage["engine"] = "onnx"
    assert "config.lora_adapters" in _raises(tmp_path, stage).message


def test_off_values_of_unhonoured_keys_are_accepted(tmp_path):
    stage = _with_config(lora_adapters={}, offload_embedding=False, context_cache={
        "enable_reuse": False, "max_records": 0, "max_snapshots": 2,
        "encoder_cache_budget_bytes": 1 << 28})
    assert load_stage_config(_write(tmp_path, {"stages": [stage]})).stage_id == "thinker"


def test_context_cache_keys_reach_the_stage_config(tmp_path):
    stage = _with_config(context_cache={"enable_reuse": True, "max_records": 64,
                                        "max_snapshots": 8})
    cfg = load_stage_config(_write(tmp_path, {"stages": [stage]}))
    assert (cfg.prefix_cache, cfg.prefix_cache_records, cfg.prefix_cache_snapshots) == \
        (True, 64, 8)
    assert not load_stage_config(_write(tmp_path, {"stages": [_stage()]})).prefix_cache


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(RunnerError) as info:
        load_stage_config(tmp_path / "absent.json")
    assert info.value.code == "NOT_FOUND"


@pytest.mark.parametrize("text", [
    "{not json", "[]", '{"stages": {}}', '{"stages": [], "extra": 1}', '"stages"',
])
def test_malformed_documents_are_config_errors(tmp_path, text):
    with pytest.raises(ConfigError) as info:
        load_stage_config(_write(tmp_path, text))
    assert info.value.code == "INVALID_ARGUMENT"


def test_defaults_and_hidden_port():
    cfg = StageConfig()
    assert (cfg.stage_id, cfg.artifact) == ("backbone", "stories260K")
    assert cfg.emits == ("text", "tokens")
    assert cfg.has_hidden_port is False
    assert StageConfig(emits=("text", "hidden")).has_hidden_port is True


# Nested LlmRunner keys: each kind of rule, with the full key path and the offending value.
@pytest.mark.parametrize("cfg, message", [
    ({"context_cache": {"max_records": "abc"}},  # type
     "config.context_cache.max_records: must be an integer >= 0, got 'abc'"),
    ({"context_cache": {"enable_reuse": 0}}, "config.context_cache.enable_reuse: must be true "
                                             "or false, got 0"),
    ({"spec_decode": {"draft_step": True}}, "config.spec_decode.draft_step: must be an integer "
                                            ">= 1, got True"),
    ({"ple": {"file": ""}}, "config.ple.file: must be a non-empty string, got ''"),
    ({"spec_decode": {"max_verify_tokens": "64"}},
     "config.spec_decode.max_verify_tokens: must be an integer >= 0, got '64'"),
    ({"spec_decode": {"max_verify_tokens": -8}},
     "config.spec_decode.max_verify_tokens: must be an integer >= 0, got -8"),
    ({"spec_decode": {"max_verify_tokens": 6.5}},
     "config.spec_decode.max_verify_tokens: must be an integer >= 0, got 6.5"),
    ({"context_cache": {"max_snapshots": -1}},  # range
     "config.context_cache.max_snapshots: must be an integer >= 0, got -1"),
    ({"spec_decode": {"dspark_confidence_threshold": 1.5}},
     "config.spec_decode.dspark_confidence_threshold: must be a number in [0, 1], got 1.5"),
    ({"visual_pruning": {"reduction_ratio": 1}},
     "config.visual_pruning.reduction_ratio: must be a number in (0, 1), got 1"),
    ({"spec_decode": {"dspark_scheduler": "fast"}},  # one of a set
     "config.spec_decode.dspark_scheduler: must be one of ['off', 'threshold', 'sps'], "
     "got 'fast'"),
    ({"ple": {"residency": "disk"}}, "config.ple.residency: must be one of ['device', 'host']"),
    ({"lora_adapters": {"a": 3}}, "config.lora_adapters.a: must be a non-empty string, got 3"),
    ({"top_k": 2.5}, "config.top_k: must be an integer >= 0, got 2.5"),
    ({"temperature": "hot"}, "config.temperature: must be a number >= 0, got 'hot'"),
    ({"top_p": 0}, "config.top_p: must be a number in (0, 1], got 0"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_nested_value_breaking_its_rule_names_the_path(tmp_path, cfg, message):
    exc = _raises(tmp_path, _with_config(**cfg))
    assert isinstance(exc, ConfigError) and exc.code == "INVALID_ARGUMENT"
    assert message in exc.message
    assert exc.message.startswith(f"{tmp_path / 'stage.json'}: stages[0].config.")


@pytest.mark.parametrize("cfg, path", [
    ({"context_cache": {"enable_reuse": False, "max_records": 8, "bogus": 1}},
     "config.context_cache.bogus"),
    ({"spec_decode": {"draft_topk": 4}}, "config.spec_decode.draft_topk"),
    ({"visual_pruning": {"ratio": 0.5}}, "config.visual_pruning.ratio"),
    ({"ple": {"slots": 4}}, "config.ple.slots"),
])
def test_unknown_sub_keys_are_refused_by_name(tmp_path, cfg, path):
    exc = _raises(tmp_path, _with_config(**cfg))
    assert isinstance(exc, ConfigError)
    assert f"{path}: unknown key (valid: [" in exc.message


@pytest.mark.parametrize("key, value, shape", [
    ("lora_adapters", [], "an object {name: path}"),
    ("lora_adapters", "a.safetensors", "an object {name: path}"),
    ("context_cache", True, "an object with keys from ['enable_reuse', "),
    ("spec_decode", [], "an object with keys from ['acceptance_warmup_steps', "),
    ("visual_pruning", 0.5, "an object with keys from ['algorithm', "),
    ("ple", "ple.bin", "an object with keys from ['cache_slots', 'file', 'residency']"),
])
def test_wrong_container_types_are_refused(tmp_path, key, value, shape):
    exc = _raises(tmp_path, _with_config(**{key: value}))
    assert isinstance(exc, ConfigError)
    assert f"config.{key}: must be {shape}" in exc.message


@pytest.mark.parametrize("key, value", [
    ("spec_decode", {"verify_tokens": 0}), ("lora_adapters", {"a": ""}),
    ("visual_pruning", {"bogus": 1}), ("ple", {"residency": "gpu"}),
    ("context_cache", {"enable_reuse": True, "max_records": "abc"}),
    ("multimodal_artifact", ""), ("draft_checkpoint", 7), ("offload_embedding", "yes"),
])
def test_shape_is_checked_before_a_key_is_refused_as_unhonoured(tmp_path, key, value):
    exc = _raises(tmp_path, _with_config(**{key: value}))
    assert exc.code == "INVALID_ARGUMENT"
    assert f"config.{key}" in exc.message


def _example_stage_files(tmp_path: Path) -> list[Path]:
    """Every stage deployment file the repository ships or documents: the JSON files under
    docker/, services/orchestrator/topologies and tests, and the ```json blocks of README.md."""
    root = Path(__file__).resolve().parents[2]
    found = [p for folder in ("docker", "services/orchestrator/topologies", "tests")
             for p in sorted((root / folder).rglob("*.json"))]
    blocks = re.findall(r"```json\n(.*?)```", (root / "README.md").read_text(), re.DOTALL)
    for i, block in enumerate(blocks):
        found.append(_write(tmp_path, block, f"readme{i}.json"))
    docs = [(p, json.loads(p.read_text())) for p in found]
    # A topology names stages by endpoints or launch; a stage file describes the stage itself.
    return [p for p, doc in docs if isinstance(doc, dict) and "stages" in doc
            and any(s.get("runner") == "llm.backbone" for s in doc["stages"])
            and not any({"endpoints", "launch"} & set(s) for s in doc["stages"])]


def test_every_example_stage_file_in_the_repository_loads(tmp_path):
    files = _example_stage_files(tmp_path)
    names = {p.name for p in files}
    assert {"thinker.json", "readme0.json"} <= names, names
    for path in files:
        assert load_stage_config(path).stage_id, path


def test_spec_decode_ngram_is_honoured_and_its_lengths_read(tmp_path):
    stage = _with_config(spec_decode={"method": "ngram", "proposal_tokens": 6,
                                      "dspark_max_proposal_len": 5,
                                      "dspark_min_proposal_len": 2})
    stage["emits"] = ["text", "tokens"]
    cfg = load_stage_config(_write(tmp_path, {"stages": [stage]}))
    assert cfg.spec is not None
    assert (cfg.spec.method, cfg.spec.proposal_tokens, cfg.spec.min_proposal) == ("ngram", 5, 2)
    assert cfg.runtime_config().spec == cfg.spec


@pytest.mark.parametrize("value, budget", [(None, 256), (0, 0), (24, 24)])
def test_spec_decode_verify_budget_is_read_with_its_default(tmp_path, value, budget):
    spec = {"proposal_tokens": 4} | ({} if value is None else {"max_verify_tokens": value})
    cfg = load_stage_config(_write(tmp_path, {"stages": [_with_config(spec_decode=spec)]}))
    assert cfg.spec is not None and cfg.spec.max_verify_tokens == budget


def test_spec_decode_self_and_draft_read_their_settings(tmp_path):
    stage = _with_config(spec_decode={"method": "self", "draft_layers": 2, "draft_step": 3,
                                      "verify_tokens": 4, "dspark_scheduler": "threshold",
                                      "dspark_confidence_threshold": 0.4})
    spec = load_stage_config(_write(tmp_path, {"stages": [stage]})).spec
    assert spec is not None
    assert (spec.method, spec.draft_layers, spec.proposal_tokens, spec.confidence_threshold) \
        == ("self", 2, 3, 0.4)
    stage = _with_config(spec_decode={"proposal_tokens": 5}, draft_checkpoint="d/draft.gguf")
    spec = load_stage_config(_write(tmp_path, {"stages": [stage]})).spec
    assert spec is not None and spec.method == "draft"
    assert spec.draft_checkpoint == str(tmp_path / "d" / "draft.gguf")


@pytest.mark.parametrize("spec, extra, code, words", [
    ({"method": "ngram"}, {}, "INVALID_ARGUMENT", "emits no hidden port"),
    ({"method": "draft"}, {}, "INVALID_ARGUMENT", "method 'draft' needs one"),
    ({"method": "self"}, {}, "INVALID_ARGUMENT", "draft_layers"),
    (None, {"draft_checkpoint": "d.gguf"}, "INVALID_ARGUMENT", "needs spec_decode"),
    ({"method": "ngram", "dspark_w2_backend": "x"}, {}, "UNIMPLEMENTED", "dspark_w2_backend"),
    ({"method": "ngram", "draft_top_k": 4}, {}, "UNIMPLEMENTED", "tree drafting"),
    ({"dspark_scheduler": "sps"}, {}, "UNIMPLEMENTED", "'sps'"),
    ({"dspark_scheduler": "threshold", "dspark_confidence_threshold": 0.5}, {},
     "INVALID_ARGUMENT", "no draft probabilities"),
    ({"method": "self", "draft_layers": 1, "dspark_confidence_threshold": 0.5}, {},
     "INVALID_ARGUMENT", "only with, dspark_scheduler 'threshold'"),
    ({"proposal_tokens": 4, "verify_tokens": 8}, {}, "INVALID_ARGUMENT", "verifies 5"),
    ({"proposal_tokens": 4, "draft_step": 2}, {}, "INVALID_ARGUMENT", "draft_step"),
])
def test_spec_decode_refusals_name_the_rule(tmp_path, spec, extra, code, words):
    stage = _with_config(**({"spec_decode": spec} if spec is not None else {}), **extra)
    if code != "INVALID_ARGUMENT" or words == "emits no hidden port":
        stage["emits"] = ["text", "tokens", "hidden"]
    exc = _raises(tmp_path, stage)
    assert exc.code == code
    assert words in exc.message
