"""Keys checked once the model loads fail as the file's own checks do: naming the key after
the stage's place in its file, and, for a relative path, what it was resolved against. A
vision-language stage whose tokenizer cannot place an image is refused at start instead of
refusing every image later."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llm_runner_svc.errors import InvalidArgument, NotFound, Unimplemented
from llm_runner_svc.models import EMBEDDED_DIR, load_model
from llm_runner_svc.stage import StageConfig, load_stage_config
from llm_runner_svc.stage.llm_stage import LlmStage
from llm_runner_svc.stage.load_checks import read_adapter


def _stage_file(tmp_path: Path, config: dict[str, Any], **stage: Any) -> Path:
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"stages": [
        {"id": "other", "runner": "talker.codec"},
        {"id": "thinker", "runner": "llm.backbone", "config": config, **stage}]}))
    return path


def test_visual_pruning_without_a_tower_names_its_place(tmp_path: Path) -> None:
    path = _stage_file(tmp_path, {"visual_pruning": {"algorithm": "dart",
                                                     "reduction_ratio": 0.5}})
    with pytest.raises(Unimplemented) as err:
        LlmStage.create(load_stage_config(path))
    assert err.value.message == (f"{path}: stages[1].config.visual_pruning: cannot be honoured: "
                                 f"model stories260K has no vision tower")


def test_a_missing_multimodal_artifact_names_the_key(tmp_path: Path) -> None:
    path = _stage_file(tmp_path, {"multimodal_artifact": "llava"})
    with pytest.raises(NotFound) as err:
        LlmStage.create(load_stage_config(path))
    assert err.value.message.startswith(
        f"{path}: stages[1].config.multimodal_artifact: {tmp_path / 'llava'} does not exist")


def test_a_relative_adapter_path_says_it_started_at_the_stage_files_folder(tmp_path: Path):
    path = _stage_file(tmp_path, {"lora_adapters": {"fr": "adapters/fr"}})
    with pytest.raises(NotFound) as err:
        LlmStage.create(load_stage_config(path))
    message = err.value.message
    assert message.startswith(f"{path}: stages[1].config.lora_adapters.fr: "
                              f"{tmp_path / 'adapters/fr/adapter_config.json'} does not exist")
    assert message.endswith(f"(a relative path starts at {tmp_path}: the stage file's folder, "
                            f"as the artifact 'stories260K' is built in)")


def test_a_relative_adapter_path_says_it_started_at_the_artifacts_folder(tmp_path: Path):
    model = EMBEDDED_DIR / "stories260K.bin"  # a model file, wherever the package lives
    path = _stage_file(tmp_path, {"lora_adapters": {"fr": "adapters/fr"}}, artifact=str(model))
    with pytest.raises(NotFound) as err:
        LlmStage.create(load_stage_config(path))
    assert err.value.message.endswith(f"(a relative path starts at {EMBEDDED_DIR}: the folder "
                                      f"of the artifact stories260K.bin)")


def test_load_adapter_says_where_a_relative_path_started() -> None:
    with pytest.raises(NotFound) as err:
        read_adapter(StageConfig(), "fr", "no/such/adapter", load_model())
    assert err.value.message.endswith(f"(a relative path starts at {Path.cwd()}: the folder "
                                      f"the stage was started in)")


def _tokenizer_without_the_placeholder(path: Path) -> None:
    """A tokenizer like the fixture's, but with no `<image>` token: it reads as bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["Once upon a time there was a picture."], trainer)
    tok.save(str(path / "tokenizer.json"))


def test_a_tokenizer_without_the_image_placeholder_is_refused_at_start(tmp_path: Path) -> None:
    vlm = pytest.importorskip("vlm_fixtures")  # needs torch and transformers
    llava = tmp_path / "llava"
    vlm.build_llava(llava)
    _tokenizer_without_the_placeholder(llava)
    path = _stage_file(tmp_path, {}, artifact="llava")
    with pytest.raises(InvalidArgument) as err:
        LlmStage.create(load_stage_config(path))
    message = err.value.message
    assert message.startswith(f"{path}: stages[1].artifact: the tokenizer of ")
    assert f"does not define the image placeholder '<image>' as token {vlm.IMAGE_TOKEN_ID}" \
        in message
