"""The deployment file: every field read, and every broken rule refused naming its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_runner_svc.engines import engine_names
from llm_runner_svc.errors import RunnerError
from llm_runner_svc.stage.config import ConfigError, StageConfig, load_stage_config

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
    ("spec_decode", True), ("draft_checkpoint", "d.gguf"), ("multimodal_artifact", "v"),
    ("visual_pruning", 0.5), ("ple", True), ("runtime_cache", "c"),
    ("lora_adapters", {"a": "x"}), ("context_cache", {"enable_reuse": True}),
    ("offload_embedding", True),
])
def test_keys_this_build_cannot_honour_are_unimplemented(tmp_path, key, value):
    exc = _raises(tmp_path, _with_config(**{key: value}))
    assert exc.code == "UNIMPLEMENTED"
    assert f"config.{key}" in exc.message


def test_off_values_of_unhonoured_keys_are_accepted(tmp_path):
    stage = _with_config(lora_adapters={}, context_cache={"enable_reuse": False},
                         offload_embedding=False)
    assert load_stage_config(_write(tmp_path, {"stages": [stage]})).stage_id == "thinker"


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
