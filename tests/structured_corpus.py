"""The structured-output corpus (tests/data/structured/) and the models it runs on.

`schemas()`: 30 JSON schemas, each with a hand-written `example` that validates; `prompts()`:
5 prompt templates with `{name}` and `{schema}`; `regexes()` and `choices()` with a prompt each.
`write_smollm2_tokenizer(dir)` writes SmolLM2-135M-Instruct's tokenizer (taken from its GGUF)
as a Hugging Face tokenizer directory, and `build_random_smollm2(dir)` a tiny random Llama over
that same 49k-token vocabulary: a model that writes nonsense fast, so only a constraint can
make its output parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

DATA = Path(__file__).resolve().parent / "data" / "structured"
# A tiny random Llama: 49152 x 64 embeddings, two layers; seconds to build and to serve.
RANDOM_CONFIG: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.05)


def _load(name: str) -> Any:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def schemas() -> list[dict[str, Any]]:
    """[{"name", "schema", "example"}] in file order."""
    return list(_load("schemas.json"))


def prompts() -> list[str]:
    return list(_load("prompts.json"))


def regexes() -> list[dict[str, str]]:
    """[{"name", "regex", "prompt"}]: the whole output must match `regex`."""
    return list(_load("regexes.json"))


def choices() -> list[dict[str, Any]]:
    """[{"name", "choices", "prompt"}]: the output must be exactly one of `choices`."""
    return list(_load("choices.json"))


def schema_prompt(template: str, entry: dict[str, Any]) -> str:
    """A prompt of `template` that names the record and spells out its schema, so an
    unconstrained model is told the same as a constrained one."""
    return template.format(name=entry["name"].replace("_", " "),
                           schema=json.dumps(entry["schema"], separators=(",", ":")))


def write_smollm2_tokenizer(path: Path) -> Path:
    """SmolLM2-135M-Instruct's tokenizer as tokenizer.json + tokenizer_config.json (with its
    chat template) in `path`; the ids are those of the GGUF's own tokenizer."""
    from llm_runner_svc.models import load_model

    model = load_model("smollm2")
    tok = model.tokenizer
    text = tok.tokenizers_json()
    assert text is not None and model.chat_template is not None
    bos, eos, unk = (tok.decode([i]) for i in (model.config.bos_id or 1,
                                               model.config.eos_ids[0], 0))
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
        "eos_token": eos, "unk_token": unk, "pad_token": eos, "add_bos_token": False,
        "chat_template": model.chat_template.source, "model_max_length": 8192}),
        encoding="utf-8")
    return path


def build_random_smollm2(path: Path, seed: int = 0) -> Path:
    """A random-weight Llama with SmolLM2's vocabulary, tokenizer and chat template, saved
    as a Hugging Face directory (config.json, model.safetensors, tokenizer files)."""
    import torch
    import transformers

    write_smollm2_tokenizer(path)
    config = transformers.LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2,
                                      **RANDOM_CONFIG)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)  # float32
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@dataclass(frozen=True)
class Answer:
    """What the service wrote for one request."""

    text: str
    finish_reason: str | None
    completion_tokens: int


def ask(api: Any, model: str, prompt: str, max_tokens: int,
        constraint: dict[str, Any] | None = None, seed: int | None = None) -> Answer:
    """One chat completion of `prompt`, greedy, or sampled at temperature 1 with `seed`;
    `constraint`: extra body fields that constrain the output (`response_format`,
    `guided_regex`, `guided_choice`), None for free text."""
    extra = dict(constraint or {})
    response_format = extra.pop("response_format", None)
    kwargs: dict[str, Any] = {"response_format": response_format} if response_format else {}
    got = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}],
        temperature=0 if seed is None else 1.0, seed=seed, max_tokens=max_tokens,
        extra_body=extra or None, **kwargs)
    usage = got.usage.completion_tokens if got.usage is not None else 0
    return Answer(got.choices[0].message.content or "", got.choices[0].finish_reason, usage)


def json_schema_format(entry: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format asking for `entry`'s schema."""
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": entry["name"], "schema": entry["schema"], "strict": True}}}


def judge_json(text: str, schema: dict[str, Any]) -> tuple[bool, bool, str]:
    """(parses as JSON, validates against `schema`, why not) of the whole `text`."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, False, f"not JSON: {exc}"
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=str)
    return True, not errors, errors[0].message if errors else ""


def lenient_json(text: str) -> str:
    """The JSON an unconstrained model most likely meant: a fenced block's body, or the text
    from its first brace to its last."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    if fenced:
        return fenced.group(1).strip()
    start, end = text.find("{"), text.rfind("}")
    return text[start:end + 1] if 0 <= start < end else text
