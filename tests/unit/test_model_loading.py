"""Model loading errors are typed and clear; the CLI runs the embedded default end to end."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llm_runner_svc.errors import InvalidArgument, ModelFormatError, NotFound
from llm_runner_svc.models import EMBEDDED_DIR, load_model


def test_unknown_model_path_is_not_found(tmp_path):
    with pytest.raises(NotFound, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_unknown_format_is_invalid(tmp_path):
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x" * 100)
    with pytest.raises(InvalidArgument, match="unknown model format"):
        load_model(f)


@pytest.mark.parametrize("keep", [10, 4096, 1_000_000])
def test_truncated_llama2c_checkpoint_is_refused(tmp_path, keep):
    data = (EMBEDDED_DIR / "stories260K.bin").read_bytes()
    (tmp_path / "m.bin").write_bytes(data[:keep])
    (tmp_path / "tok512.bin").write_bytes((EMBEDDED_DIR / "tok512.bin").read_bytes())
    with pytest.raises(ModelFormatError, match="too short|truncated"):
        load_model(tmp_path / "m.bin")


def test_truncated_llama2c_tokenizer_is_refused(tmp_path):
    (tmp_path / "m.bin").write_bytes((EMBEDDED_DIR / "stories260K.bin").read_bytes())
    (tmp_path / "tokenizer.bin").write_bytes((EMBEDDED_DIR / "tok512.bin").read_bytes()[:3000])
    with pytest.raises(ModelFormatError, match="truncated tokenizer"):
        load_model(tmp_path / "m.bin")


def test_copied_checkpoint_loads_like_the_embedded_one(tmp_path, stories):
    (tmp_path / "m.bin").write_bytes((EMBEDDED_DIR / "stories260K.bin").read_bytes())
    (tmp_path / "tok512.bin").write_bytes((EMBEDDED_DIR / "tok512.bin").read_bytes())
    m = load_model(tmp_path / "m.bin")
    assert m.config == stories.config
    assert m.tokenizer.encode("Once upon a time") == stories.tokenizer.encode("Once upon a time")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llm_runner_svc", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_generates_with_the_embedded_model(goldens):
    case = next(c for c in goldens["cases"] if c["name"] == "greedy_dragon")
    res = _cli("generate", "--temperature", "0", "--max-tokens", "20", case["prompt"])
    assert res.returncode == 0, res.stderr
    assert case["text"].startswith(res.stdout.rstrip("\n"))
    assert len(res.stdout) > len(case["prompt"]) + 40
    assert "[max_length]" in res.stderr and "generated_tokens=20" in res.stderr


def test_cli_reports_bad_input_with_its_status():
    res = _cli("generate", "--top-p", "1.5", "hello")
    assert res.returncode == 2
    assert "INVALID_ARGUMENT" in res.stderr and "top_p" in res.stderr
    res = _cli("generate", "--model", "/no/such/model.gguf", "hello")
    assert res.returncode == 2 and "NOT_FOUND" in res.stderr
