"""Vision-language directories (LLaVA with a CLIP tower and Llama, LLaVA with SigLIP and
Qwen2, Idefics3 with pixel shuffle and Llama): the vision tower's embeddings, the logits of
prompts with one and two images and greedy tokens against transformers' own model, all
float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vlm_fixtures import IMAGE_SIZE, IMAGE_TOKEN_ID, build_idefics3, build_llava  # noqa: E402

from llm_runner_svc.engines.base import EnginePlan  # noqa: E402
from llm_runner_svc.engines.batch import Batch, EmbedSpan, Row  # noqa: E402
from llm_runner_svc.engines.numpy_engine import NumpyEngine  # noqa: E402
from llm_runner_svc.engines.numpy_vision import NumpyVision  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402
from llm_runner_svc.models.vision import image_starts  # noqa: E402
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve  # noqa: E402

CASES = [("clip", "llama"), ("siglip", "qwen2"), ("idefics3", "llama")]
TOL = 1e-4


def _pixels(num: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(num, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(
        np.float32)


def _prompt(model: Any, num_images: int) -> list[int]:
    """<s> text <image>*n text [<image>*n text]: placeholders expanded as the processor does."""
    tok, n = model.tokenizer, model.vision.config.tokens_per_image
    ids = [0, *tok.encode("Describe the image.", add_bos=False)]
    for i in range(num_images):
        ids += [IMAGE_TOKEN_ID] * n + tok.encode(f" picture {i} has a cat", add_bos=False)
    return ids


def _pixel_values(tm: Any, pixels: np.ndarray) -> torch.Tensor:
    """Idefics3 takes [batch, images, C, H, W]; LLaVA [images, C, H, W]."""
    t = torch.from_numpy(pixels)
    return t[None] if tm.config.model_type == "idefics3" else t


def _features(tm: Any, pixels: np.ndarray) -> np.ndarray:
    """transformers' image features, [images, tokens, hidden]."""
    with torch.no_grad():
        out = tm.get_image_features(pixel_values=_pixel_values(tm, pixels)).pooler_output
    return np.concatenate([f.numpy() for f in out]).reshape(len(pixels), -1, out[0].shape[-1])


def _theirs(tm: Any, ids: list[int], pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = tm(input_ids=torch.tensor([ids]), pixel_values=_pixel_values(tm, pixels))
    return out.logits[0].numpy()


def _close(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    scale = float(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=TOL, atol=TOL * scale, err_msg=what)


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def llava(request: Any, tmp_path: Path) -> tuple[Any, Any, str]:
    tower, text = request.param
    if tower == "idefics3":
        tm = build_idefics3(tmp_path / "vlm")
    else:
        tm = build_llava(tmp_path / "vlm", tower, text)
    return load_model(tmp_path / "vlm"), tm, tower


def test_vision_embeddings_match(llava: tuple[Any, Any, str]) -> None:
    model, tm, tower = llava
    vc = model.vision.config
    assert vc.tower.startswith(tower)
    assert vc.tokens_per_image == (IMAGE_SIZE // 4) ** 2 // (4 if tower == "idefics3" else 1)
    pixels = _pixels(2)
    ours = NumpyVision(vc, model.vision.weights).encode(pixels)
    theirs = _features(tm, pixels)
    assert ours.shape == theirs.shape == (2, vc.tokens_per_image, model.config.hidden_size)
    _close(ours, theirs, "image features")


@pytest.mark.parametrize("num_images", [1, 2])
@pytest.mark.parametrize("chunk", [256, 7])
def test_prefill_logits_match(llava: tuple[Any, Any, str], num_images: int,
                              chunk: int) -> None:
    """Every position's logits of a prompt with images, prefilled in one pass or in chunks
    that cut through an image."""
    model, tm, _ = llava
    vc = model.vision.config
    ids = _prompt(model, num_images)
    pixels = _pixels(num_images, seed=num_images)
    feats = NumpyVision(vc, model.vision.weights).encode(pixels)
    starts = image_starts(ids, IMAGE_TOKEN_ID, [vc.tokens_per_image] * num_images)
    spans = tuple(EmbedSpan(s, f) for s, f in zip(starts, feats, strict=True))
    theirs = _theirs(tm, ids, pixels)
    engine = NumpyEngine(model.config, model.weights)
    engine.preallocate(EnginePlan(max_batch=1, max_seq=128, page_size=8, num_pages=16,
                                  prefill_chunk=chunk))
    pages = list(range(15, -1, -1))
    ours = []
    for pos in range(len(ids)):  # one row per position: each position's own logits
        row = Row(tuple(ids[pos:pos + 1]) if pos else tuple(ids[:1]), pos, pages, embeds=spans)
        engine.read(engine.launch(Batch((row,), keep_logits=True)))
        ours.append(engine.logits(1)[0].copy())
    _close(np.stack(ours), theirs, "per-position logits")
    # the whole prompt as one row (passes of `chunk`), over the KV the rows above wrote
    engine.read(engine.launch(Batch((Row(tuple(ids), 0, pages, embeds=spans),),
                                    keep_logits=True)))
    _close(engine.logits(1)[0], theirs[-1], "prefill of the whole prompt")
    engine.close()


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_tokens_match(llava: tuple[Any, Any, str], num_images: int) -> None:
    model, tm, _ = llava
    vc = model.vision.config
    ids = _prompt(model, num_images)
    pixels = _pixels(num_images, seed=10 + num_images)
    feats = NumpyVision(vc, model.vision.weights).encode(pixels)
    starts = image_starts(ids, IMAGE_TOKEN_ID, [vc.tokens_per_image] * num_images)
    ref: list[int] = []  # transformers' greedy choice, each from a full forward
    for _ in range(12):
        ref.append(int(np.argmax(_theirs(tm, ids + ref, pixels)[-1])))
    rt = InferenceRuntime(NumpyEngine(model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=2, max_seq=128, page_size=8,
                                        max_tokens_per_step=16))
    rt.preallocate()
    req = GenerationRequest("r", ids, resolve(rt.config.sampling, temperature=0.0,
                                              max_new_tokens=12),
                            ignore_eos=True,
                            embeds=tuple(EmbedSpan(s, f) for s, f in zip(starts, feats,
                                                                         strict=True)))
    ours = [t for ev in rt.generate(req) for t in ev.token_ids]
    rt.close()
    assert ours == ref


def test_torch_cpu_tower_and_prefill_match(llava: tuple[Any, Any, str]) -> None:
    """The torch engine (CPU, float32): its vision tower and a prompt with two images."""
    from llm_runner_svc.engines.torch_engine import TorchEngine
    from llm_runner_svc.engines.torch_vision import TorchVision

    model, tm, _ = llava
    vc = model.vision.config
    engine = TorchEngine(model.config, model.weights, device="cpu")
    pixels = _pixels(2, seed=5)
    feats = TorchVision(vc, model.vision.weights, engine).encode(pixels)
    _close(feats, NumpyVision(vc, model.vision.weights).encode(pixels), "torch tower")
    ids = _prompt(model, 2)
    starts = image_starts(ids, IMAGE_TOKEN_ID, [vc.tokens_per_image] * 2)
    spans = tuple(EmbedSpan(s, f) for s, f in zip(starts, feats, strict=True))
    engine.preallocate(EnginePlan(max_batch=2, max_seq=128, page_size=8, num_pages=16,
                                  prefill_chunk=32, step_tokens=32))
    pages = list(range(16))
    engine.read(engine.launch(Batch((Row(tuple(ids), 0, pages, embeds=spans),),
                                    keep_logits=True)))
    _close(engine.logits(1)[0], _theirs(tm, ids, pixels)[-1], "torch prefill")
    engine.close()


def test_multimodal_artifact_brings_the_tower_to_a_text_model(tmp_path: Path,
                                                              hf_model_dir: Any) -> None:
    """`multimodal_artifact`: the tower of a LLaVA directory beside a text-only model of the
    same width; a tower whose projector does not fit the text model is refused by name."""
    from llm_runner_svc.errors import ModelFormatError

    build_llava(tmp_path / "llava", "clip", "llama")
    text_dir, _ = hf_model_dir("llama")
    model = load_model(text_dir, multimodal=tmp_path / "llava")
    assert model.vision is not None and model.vision.config.text_hidden_size == 64
    assert model.vision.image_token == "<image>"
    assert load_model(text_dir).vision is None
    wide_dir, _ = hf_model_dir("llama", name="wide", hidden_size=96)
    with pytest.raises(ModelFormatError, match="projector"):
        load_model(wide_dir, multimodal=tmp_path / "llava")


def test_image_requests_batched_and_preempted_keep_their_tokens(tmp_path: Path) -> None:
    """Three requests with images in one runtime whose KV pool holds about two of them: they
    prefill in chunks beside each other's decodes, one is preempted and recomputes its
    prompt (images included), and each gets the tokens it gets alone."""
    build_llava(tmp_path / "llava", "clip", "llama", seed=6)
    model = load_model(tmp_path / "llava")
    vc = model.vision.config
    tower = NumpyVision(vc, model.vision.weights)
    reqs = []
    for i in range(3):
        ids = _prompt(model, 1 + i % 2)
        n = ids.count(IMAGE_TOKEN_ID) // vc.tokens_per_image
        feats = tower.encode(_pixels(n, seed=20 + i))
        starts = image_starts(ids, IMAGE_TOKEN_ID, [vc.tokens_per_image] * n)
        reqs.append((ids, tuple(EmbedSpan(s, f, bytes([i, j])) for j, (s, f) in
                                enumerate(zip(starts, feats, strict=True)))))

    def runtime(**kw: Any) -> InferenceRuntime:
        rt = InferenceRuntime(NumpyEngine(model.config, model.weights), model.tokenizer,
                              RuntimeConfig(max_batch=3, max_seq=128, page_size=8,
                                            max_tokens_per_step=16, **kw))
        rt.preallocate()
        return rt

    def request(i: int, rt: InferenceRuntime) -> GenerationRequest:
        ids, spans = reqs[i]
        return GenerationRequest(f"r{i}", ids, resolve(rt.config.sampling, temperature=0.0,
                                                       max_new_tokens=16),
                                 ignore_eos=True, embeds=spans)

    alone = {}
    rt = runtime()
    for i in range(3):
        alone[f"r{i}"] = [t for ev in rt.generate(request(i, rt)) for t in ev.token_ids]
    rt.close()
    rt = runtime(kv_memory_bytes=2 * 80 * model.config.num_layers * 2 * model.config.kv_dim * 4)
    for i in range(3):
        rt.submit(request(i, rt))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    done = 0
    while done < 3:
        for ev in rt.step():
            got[ev.request_id] += ev.token_ids
            done += ev.finish_reason is not None
    assert rt.scheduler.preemptions > 0
    rt.close()
    assert got == alone
