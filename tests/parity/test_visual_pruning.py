"""Visual pruning (DART style) at ratio 0.5: the kept count, the kept set against a
reference written here from the definition (plain Python), and the output against
transformers fed exactly the kept tokens, in order, at consecutive positions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vlm_fixtures import IMAGE_SIZE, IMAGE_TOKEN_ID, build_llava  # noqa: E402

from llm_runner_svc.engines.base import EnginePlan  # noqa: E402
from llm_runner_svc.engines.batch import Batch, Row  # noqa: E402
from llm_runner_svc.engines.numpy_engine import NumpyEngine  # noqa: E402
from llm_runner_svc.engines.numpy_vision import NumpyVision  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402
from llm_runner_svc.models.image_processing import MIME_FORMATS  # noqa: E402
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve  # noqa: E402
from llm_runner_svc.stage import MediaItem, StageRequest  # noqa: E402
from llm_runner_svc.stage.images import ImageEncoder  # noqa: E402
from llm_runner_svc.stage.limits import RequestLimits  # noqa: E402
from llm_runner_svc.stage.visual_pruning import PruningConfig, prune  # noqa: E402

CFG = PruningConfig(reduction_ratio=0.5, min_visual_tokens=2, pivot_image_tokens=2,
                    pivot_text_tokens=3)


def reference_kept(visual: list[list[float]], text: list[list[float]], ratio: float,
                   min_keep: int, num_image_pivots: int, num_text_pivots: int) -> list[int]:
    """The definition, one token at a time."""
    def norm(v: list[float]) -> float:
        return math.sqrt(sum(x * x for x in v))

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))

    n = len(visual)
    image_pivots = sorted(range(n), key=lambda i: (-norm(visual[i]), i))[:num_image_pivots]
    text_pivots = sorted(range(len(text)), key=lambda j: (-norm(text[j]), j))[
        :num_text_pivots]
    pivots = [visual[i] for i in image_pivots] + [text[j] for j in text_pivots]
    keep = min(n, max(round(n * (1 - ratio)), min_keep, 1, len(image_pivots)))
    score = {i: max(cos(visual[i], p) for p in pivots) for i in range(n)
             if i not in image_pivots}
    others = sorted(score, key=lambda i: (score[i], i))[:keep - len(image_pivots)]
    return sorted(image_pivots + others)


def test_prune_matches_the_reference_on_random_tokens() -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(4, 40))
        visual = rng.normal(size=(n, 16)).astype(np.float32)
        visual[rng.integers(0, n, 3)] *= 3  # a few loud tokens
        text = rng.normal(size=(int(rng.integers(1, 9)), 16)).astype(np.float32)
        cfg = PruningConfig(float(rng.choice([0.25, 0.5, 0.75])), int(rng.integers(1, 6)),
                            int(rng.integers(1, 5)), int(rng.integers(0, 4)))
        got = prune(visual, text, cfg).tolist()
        want = reference_kept(visual.tolist(), text.tolist(), cfg.reduction_ratio,
                              cfg.min_visual_tokens, cfg.pivot_image_tokens,
                              cfg.pivot_text_tokens)
        assert got == want, f"trial {trial}"
    assert len(prune(rng.normal(size=(16, 8)), rng.normal(size=(3, 8)), CFG)) == 8
    few = PruningConfig(0.9, min_visual_tokens=6, pivot_image_tokens=1, pivot_text_tokens=0)
    assert len(prune(rng.normal(size=(16, 8)), rng.normal(size=(3, 8)), few)) == 6


@pytest.fixture
def llava(tmp_path: Path) -> tuple[Any, Any]:
    tm = build_llava(tmp_path / "llava", "clip", "llama", seed=4)
    return load_model(tmp_path / "llava"), tm


def test_pruned_prompt_equals_transformers_fed_the_kept_tokens(
        llava: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tm = llava
    vc = model.vision.config
    rng = np.random.default_rng(9)
    pixels = rng.normal(size=(2, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)
    # the encoder's input: these pixels for the two media items (decoding bypassed)
    decoded = {b"a": pixels[0], b"b": pixels[1]}
    monkeypatch.setattr("llm_runner_svc.stage.images.decode_image",
                        lambda data, mime, max_pixels: data)
    monkeypatch.setattr("llm_runner_svc.stage.images.preprocess",
                        lambda img, cfg, size: decoded[img])
    encoder = ImageEncoder(model, NumpyVision(vc, model.vision.weights), RequestLimits(),
                           pruning=CFG)
    tok = model.tokenizer
    prompt = [0, *tok.encode("Describe", add_bos=False), IMAGE_TOKEN_ID,
              *tok.encode(" and", add_bos=False), IMAGE_TOKEN_ID,
              *tok.encode(" the cat", add_bos=False)]
    mime = next(iter(MIME_FORMATS))
    req = StageRequest("p", token_ids=tuple(prompt),
                       media=(MediaItem(mime, b"a"), MediaItem(mime, b"b")))
    admitted = encoder.admit(req, prompt)
    assert admitted.media.visual_tokens_before == 2 * vc.tokens_per_image == 32
    assert admitted.media.visual_tokens_after == 16  # ratio 0.5
    assert [len(s.values) for s in admitted.embeds] == [8, 8]

    # the kept sets, by the reference, from transformers' own image features
    with torch.no_grad():
        feats = [f.numpy() for f in tm.get_image_features(
            pixel_values=torch.from_numpy(pixels)).pooler_output]
    text = [t for t in prompt if t != IMAGE_TOKEN_ID]
    text_emb = model.weights.embedding[text].tolist()
    kept = [reference_kept(f.tolist(), text_emb, 0.5, 2, 2, 3) for f in feats]
    for span, f, k in zip(admitted.embeds, feats, kept, strict=True):
        np.testing.assert_allclose(span.values, f[k], rtol=1e-4,
                                   atol=1e-4 * float(np.abs(f).max()))

    # transformers fed the text and exactly the kept tokens, in order
    pieces: list[torch.Tensor] = []
    image = 0
    embed = tm.get_input_embeddings()
    ids: list[int] = []
    for t in prompt:
        if t == IMAGE_TOKEN_ID:
            pieces.append(torch.from_numpy(feats[image][kept[image]]))
            ids += [IMAGE_TOKEN_ID] * len(kept[image])
            image += 1
        else:
            pieces.append(embed(torch.tensor([t])).detach())
            ids.append(t)
    assert list(admitted) == ids
    ref: list[int] = []
    emb = torch.cat(pieces)
    first = None
    for _ in range(10):
        with torch.no_grad():
            logits = tm(inputs_embeds=emb[None]).logits[0, -1]
        first = logits.numpy() if first is None else first
        ref.append(int(logits.argmax()))
        emb = torch.cat([emb, embed(torch.tensor([ref[-1]])).detach()])

    engine = NumpyEngine(model.config, model.weights)
    engine.preallocate(EnginePlan(max_batch=1, max_seq=128, page_size=8, num_pages=16))
    engine.read(engine.launch(Batch((Row(tuple(ids), 0, list(range(16)),
                                         embeds=admitted.embeds),), keep_logits=True)))
    np.testing.assert_allclose(engine.logits(1)[0], first, rtol=1e-4,
                               atol=1e-4 * float(np.abs(first).max()))
    engine.close()
    rt = InferenceRuntime(NumpyEngine(model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=2, max_seq=128, page_size=8))
    rt.preallocate()
    run = GenerationRequest("p", list(admitted), resolve(rt.config.sampling, temperature=0.0,
                                                         max_new_tokens=10),
                            ignore_eos=True, embeds=admitted.embeds)
    ours = [t for ev in rt.generate(run) for t in ev.token_ids]
    rt.close()
    assert ours == ref
