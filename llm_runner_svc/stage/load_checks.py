"""The stage keys that can only be checked against the files they name or the model they
load: `config.multimodal_artifact`, the image placeholder of a vision-language model,
`config.visual_pruning`, `config.lora_adapters`. Each error names its key as the file checks
do, after the stage's place in its file (`stage.json: stages[0].config.lora_adapters.fr:
...`), so a failure at load reads like one at parse time.
"""

from __future__ import annotations

from pathlib import Path

from llm_runner_svc.errors import InvalidArgument, NotFound, Unimplemented
from llm_runner_svc.models import Model
from llm_runner_svc.models.lora import LoraAdapter, load_adapter
from llm_runner_svc.stage.config import StageConfig


def check_multimodal_path(config: StageConfig) -> None:
    """Before the model loads: `config.multimodal_artifact` names a directory with a
    config.json. NotFound otherwise."""
    if not config.multimodal_artifact:
        return
    where = Path(config.multimodal_artifact).absolute()
    if not (where / "config.json").is_file():
        what = "does not exist" if not where.exists() else "has no config.json"
        raise NotFound(f"{config.where('config.multimodal_artifact')}: {where} {what} (a "
                       f"LLaVA directory whose vision tower serves the images)")


def check_vision(config: StageConfig, model: Model) -> None:
    """After the model loads: `config.visual_pruning` needs a vision tower, and the tower's
    image placeholder must be one token of the tokenizer prompts are read with (else every
    image would be refused at Admit, its prompt placing none)."""
    if model.vision is None:
        if config.visual_pruning is not None:
            raise Unimplemented(f"{config.where('config.visual_pruning')}: cannot be honoured: "
                                f"model {model.name} has no vision tower")
        return
    key = "config.multimodal_artifact" if config.multimodal_artifact else "artifact"
    token, token_id = model.vision.image_token, model.vision.config.image_token_id
    ids = model.tokenizer.encode(token, add_bos=False)
    if ids != [token_id]:
        raise InvalidArgument(
            f"{config.where(key)}: the tokenizer of {model.name} does not define the image "
            f"placeholder {token!r} as token {token_id} (image_token_index): it reads "
            f"{token!r} as {ids}, so no prompt could place an image; use the tokenizer the "
            f"vision-language model was trained with")


def load_adapters(config: StageConfig, model: Model) -> list[LoraAdapter]:
    """`config.lora_adapters`, each read and checked against the model; an error names the
    adapter's key and, for a path given relative, what it was resolved against."""
    adapters = []
    for name, path in config.lora_adapters:
        key = config.where(f"config.lora_adapters.{name}")
        try:
            adapters.append(load_adapter(name, Path(path), model.config))
        except NotFound as exc:
            raise NotFound(f"{key}: {exc.message}{_resolved(config, path)}") from exc
        except InvalidArgument as exc:
            raise type(exc)(f"{key}: {exc.message}") from exc
    return adapters


def read_adapter(config: StageConfig, name: str, path: str, model: Model) -> LoraAdapter:
    """LoadAdapter's adapter: `path` relative to the stage's adapter root; a missing file's
    error says what the path was resolved against."""
    where = Path(path)
    if not where.is_absolute():
        where = Path(config.adapter_root or ".") / where
    try:
        return load_adapter(name, where, model.config)
    except NotFound as exc:
        raise NotFound(f"{exc.message}{_resolved(config, str(where))}") from exc


def _resolved(config: StageConfig, path: str) -> str:
    root = Path(config.adapter_root or ".")
    if not Path(path).is_relative_to(root):
        return ""
    why = config.adapter_root_is or "the folder the stage was started in"
    return f" (a relative path starts at {root.absolute()}: {why})"
