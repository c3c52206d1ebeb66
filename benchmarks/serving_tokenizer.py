"""A served model's tokenizer as a Hugging Face tokenizer directory (tokenizer.json +
tokenizer_config.json), for load generators that count and synthesize tokens with one, on a
machine that downloads nothing.

The directory is laid out as an entry of a local Hugging Face hub cache
(`<hub>/models--<org>--<name>/snapshots/<revision>/` with `refs/main` naming the revision), so
a tool that takes only a hub id when HF_HUB_OFFLINE=1 finds it under `HF_HUB_CACHE=<hub>` by
the id `create_hub_entry` returns.

llama2.c's tokenizer (the embedded stories260K) becomes a byte-fallback BPE whose merges are
ranked by the merged piece's score, the SentencePiece-style model llama2.c trained; the byte
BPE of GGUF and Hugging Face checkpoints is saved as the model loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers
from tokenizers import Tokenizer as HfTokenizer

from llm_runner_svc.models import load_model
from llm_runner_svc.models.gguf_loader import GgufBpeTokenizer
from llm_runner_svc.models.hf import HfTokenizer as HfDirTokenizer
from llm_runner_svc.models.llama2c import Llama2cTokenizer

HUB_ORG = "llm-runner-svc"
REVISION = "0" * 40  # one fixed snapshot: the directory is rewritten, never versioned
_SPACE = "\u2581"  # SentencePiece's visible space
_LLAMA2C_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>"}
_FIRST_MERGEABLE = 259  # llama2.c: 3 specials, then the 256 byte pieces <0x00>..<0xFF>


def llama2c_to_hf(tok: Llama2cTokenizer) -> HfTokenizer:
    """The same ids as `tok.encode(text, add_bos=False)` and the same text back."""
    pieces = [_LLAMA2C_SPECIAL.get(i) or p.decode("utf-8", errors="replace").replace(" ", _SPACE)
              for i, p in enumerate(tok.pieces)]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for i in range(_FIRST_MERGEABLE, len(pieces)):
        piece, score = pieces[i], tok.scores[i]
        if score <= -1e10 or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, i, vocab[left], vocab[right], left, right))
    ranked.sort()
    hf = HfTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked],
                                unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE),
                                          normalizers.Replace(Regex(" "), _SPACE)])
    hf.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in _LLAMA2C_SPECIAL.values()])
    return hf


def export(model: str | None, out: Path) -> None:
    """Writes `model`'s tokenizer (a load_model name or path) into the directory `out`."""
    loaded = load_model(model)
    tok = loaded.tokenizer
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "model_max_length": loaded.config.max_position,
                              "add_bos_token": False}  # prompts go out as text: no BOS added
    if isinstance(tok, Llama2cTokenizer):
        hf = llama2c_to_hf(tok)
        config.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    elif isinstance(tok, GgufBpeTokenizer | HfDirTokenizer):
        hf = tok._tok  # the loaded tokenizers object, as the stage encodes with it
        if tok.bos_id is not None:
            config["bos_token"] = hf.id_to_token(tok.bos_id)
        if tok.eos_ids:
            config["eos_token"] = hf.id_to_token(tok.eos_ids[0])
    else:
        raise TypeError(f"no Hugging Face form of a {type(tok).__name__}")
    if loaded.chat_template is not None:
        config["chat_template"] = loaded.chat_template.source
    out.mkdir(parents=True, exist_ok=True)
    hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def create_hub_entry(model: str | None, hub: Path) -> str:
    """Exports `model`'s tokenizer into the local hub cache `hub`; returns its hub id."""
    name = Path(model).stem if model else "stories260K"
    repo = hub / f"models--{HUB_ORG}--{name}"
    export(model, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return f"{HUB_ORG}/{name}"
