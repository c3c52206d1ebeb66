"""Images on the torch engine on a CUDA GPU (benchmarks/gpu_vision.sh runs this; CI has no
GPU). float32: the vision tower and the logits of a prompt with two images within 1e-4 of
transformers, greedy tokens equal to the numpy engine's. bf16: the tower within the bf16
product tolerance of test_torch_gpu.py (BF16_CUBLAS_REL), and the prompt's logits against
the numpy engine on the same bf16-rounded weights fed the same image embeddings: the argmax
agrees wherever the reference's lead exceeds BF16_MARGIN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_gpu import BF16_CUBLAS_REL, BF16_MARGIN, _clear_leads_agree, _rel, bf16_weights  # noqa: E402
from vlm_fixtures import IMAGE_SIZE, IMAGE_TOKEN_ID, build_llava  # noqa: E402

from llm_runner_svc.engines.base import EnginePlan  # noqa: E402
from llm_runner_svc.engines.batch import Batch, EmbedSpan, Row  # noqa: E402
from llm_runner_svc.engines.numpy_engine import NumpyEngine  # noqa: E402
from llm_runner_svc.engines.numpy_vision import NumpyVision  # noqa: E402
from llm_runner_svc.engines.torch_engine import TorchEngine  # noqa: E402
from llm_runner_svc.engines.torch_vision import TorchVision  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402
from llm_runner_svc.models.vision import image_starts  # noqa: E402
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(tmp_path: Path, tower: str) -> tuple[Any, Any, list[int], np.ndarray]:
    text = "llama" if tower == "clip" else "qwen2"
    tm = build_llava(tmp_path / tower, tower, text)
    model = load_model(tmp_path / tower)
    n = model.vision.config.tokens_per_image
    tok = model.tokenizer
    ids = [0, *tok.encode("Describe", add_bos=False), *[IMAGE_TOKEN_ID] * n,
           *tok.encode(" and", add_bos=False), *[IMAGE_TOKEN_ID] * n,
           *tok.encode(" cat", add_bos=False)]
    pixels = np.random.default_rng(3).normal(size=(2, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(
        np.float32)
    return model, tm, ids, pixels


def _spans(model: Any, ids: list[int], feats: np.ndarray) -> tuple[EmbedSpan, ...]:
    starts = image_starts(ids, IMAGE_TOKEN_ID, [model.vision.config.tokens_per_image] * 2)
    return tuple(EmbedSpan(s, f) for s, f in zip(starts, feats, strict=True))


def _prefill_logits(engine: Any, ids: list[int], spans: tuple[EmbedSpan, ...]) -> np.ndarray:
    engine.preallocate(EnginePlan(max_batch=2, max_seq=128, page_size=16, num_pages=8,
                                  prefill_chunk=64, step_tokens=64))
    engine.read(engine.launch(Batch((Row(tuple(ids), 0, list(range(8)), embeds=spans),),
                                    keep_logits=True)))
    out = np.array(engine.logits(1)[0], copy=True)
    engine.close()
    return out


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_float32_on_gpu_matches_transformers(tower: str, tmp_path: Path) -> None:
    model, tm, ids, pixels = _case(tmp_path, tower)
    engine = TorchEngine(model.config, model.weights, device="cuda", dtype="float32")
    feats = TorchVision(model.vision.config, model.vision.weights, engine).encode(pixels)
    with torch.no_grad():
        out = tm.get_image_features(pixel_values=torch.from_numpy(pixels))
        # transformers 5.2x returns an output with pooler_output; earlier ones the features
        ref_feats = np.stack([f.numpy() for f in getattr(out, "pooler_output", out)])
        ref = tm(input_ids=torch.tensor([ids]),
                 pixel_values=torch.from_numpy(pixels)).logits[0, -1].numpy()
    scale = float(np.abs(ref_feats).max())
    np.testing.assert_allclose(feats, ref_feats, rtol=1e-4, atol=1e-4 * scale)
    logits = _prefill_logits(engine, ids, _spans(model, ids, feats))
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    greedy = []
    for eng in (TorchEngine(model.config, model.weights, device="cuda", dtype="float32"),
                NumpyEngine(model.config, model.weights)):
        rt = InferenceRuntime(eng, model.tokenizer, RuntimeConfig(max_batch=2, max_seq=128,
                                                                  page_size=16))
        rt.preallocate()
        req = GenerationRequest("g", ids, resolve(rt.config.sampling, temperature=0.0,
                                                  max_new_tokens=12), ignore_eos=True,
                                embeds=_spans(model, ids, feats))
        greedy.append([t for ev in rt.generate(req) for t in ev.token_ids])
        rt.close()
    assert greedy[0] == greedy[1]


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_bf16_on_gpu_within_the_bf16_tolerances(tower: str, tmp_path: Path) -> None:
    model, _, ids, pixels = _case(tmp_path, tower)
    engine = TorchEngine(model.config, model.weights, device="cuda", dtype="bfloat16")
    feats = TorchVision(model.vision.config, model.vision.weights, engine).encode(pixels)
    ref_feats = NumpyVision(model.vision.config, model.vision.weights).encode(pixels)
    rel = _rel(feats, ref_feats)
    print(f"{tower}: bf16 tower relative error {rel:.2e}")
    assert rel < BF16_CUBLAS_REL
    spans = _spans(model, ids, feats)
    got = _prefill_logits(engine, ids, spans)
    rounded = bf16_weights(model)
    want = _prefill_logits(NumpyEngine(rounded.config, rounded.weights), ids, spans)
    print(f"{tower}: bf16 prefill logits relative error {_rel(got, want):.2e}")
    assert _rel(got, want) < BF16_CUBLAS_REL
    _clear_leads_agree(got[None], want[None], BF16_MARGIN)
