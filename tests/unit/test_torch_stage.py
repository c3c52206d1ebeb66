"""The torch engine chosen by configuration: the stage file's `engine` and `device` keys, the
CLI's --engine/--device, a Stage service over real gRPC running it, and `--engine numpy`
never importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stage_harness import StageServer

from llm_runner_svc.stage import StageConfig, load_stage_config
from llm_runner_svc.stage.config import ConfigError
from services.contract.llmstage.v1 import stage_pb2 as pb


def _stage_file(tmp_path, **stage):
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"stages": [{"id": "s", "runner": "llm.backbone", **stage}]}))
    return path


def test_device_key_reaches_the_engine_options(tmp_path):
    cfg = load_stage_config(_stage_file(tmp_path, engine="torch", device="cpu"))
    assert (cfg.engine, cfg.device) == ("torch", "cpu")
    assert cfg.engine_options() == {"device": "cpu"}
    assert load_stage_config(_stage_file(tmp_path, engine="torch")).engine_options() == {}


@pytest.mark.parametrize("stage, message", [
    ({"engine": "numpy", "device": "cpu"}, "only the 'torch' engine"),
    ({"engine": "torch", "device": "gpu0"}, "'cpu', 'cuda' or 'cuda:N'"),
    ({"engine": "torch", "device": 0}, "device: must be a str"),
])
def test_bad_device_settings_fail_at_load(tmp_path, stage, message):
    with pytest.raises(ConfigError, match=message):
        load_stage_config(_stage_file(tmp_path, **stage))


def test_stage_serves_the_goldens_on_the_torch_engine(goldens):
    pytest.importorskip("torch")
    from llm_runner_svc.engines.torch_engine import TorchEngine

    case = next(c for c in goldens["cases"] if c["name"] == "greedy_from_bos")
    with StageServer(StageConfig(engine="torch", device="cpu", max_seq=512)) as srv:
        assert isinstance(srv.stage.runtime.engine, TorchEngine)
        assert srv.stub.Describe(pb.DescribeRequest()).engine == "torch"
        srv.admit_prepare(1, token_ids=case["prompt_token_ids"], temperature=0.0,
                          max_tokens=case["steps"])
        out = srv.step([1], credits=64).collect({1})
        assert out[1]["tokens"] == case["generated_token_ids"]
        assert out[1]["text"] == case["text"]


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = ("import sys; from llm_runner_svc.cli import main; rc = main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr); "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)


def test_numpy_engine_never_imports_torch():
    res = _run_cli("generate", "--engine", "numpy", "--max-tokens", "8", "--temperature", "0",
                   "Once upon a time")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().endswith("no torch")


def test_cli_runs_the_torch_engine_on_the_cpu():
    pytest.importorskip("torch")
    args = ("generate", "--max-tokens", "12", "--temperature", "0", "Once upon a time")
    numpy_run = _run_cli(*args, "--engine", "numpy")
    torch_run = _run_cli(*args, "--engine", "torch", "--device", "cpu")
    assert torch_run.returncode == 0, torch_run.stderr
    assert torch_run.stderr.strip().endswith("torch loaded")
    assert torch_run.stdout == numpy_run.stdout
    assert len(torch_run.stdout) > len("Once upon a time") + 12
    wrong = _run_cli(*args, "--engine", "numpy", "--device", "cpu")
    assert wrong.returncode == 2 and "--device needs --engine torch" in wrong.stderr
