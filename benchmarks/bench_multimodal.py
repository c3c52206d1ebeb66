"""Image-to-first-token time on the CPU (numpy engine): the encoder and the prefill of
requests that each carry one image, at several concurrencies.

The model is a random LLaVA built with transformers here (nothing downloaded): by default a
ViT-S/16 CLIP tower at 224 px (196 image tokens) and an 8-layer decoder of SmolLM2-135M's
width. The stage's path is replayed in-process: one worker thread decodes, preprocesses and
encodes the requests' PNGs one after another (as Admit's worker does) and hands each to the
runtime, which the main thread steps; a request's time runs from the moment all C requests
arrive to its first token. Modes, each against the baseline in the same run:
  cold        every image new: decode + tower + prefill of every token (the baseline)
  pruned      the same, DART pruning at ratio 0.5 (half the image tokens prefilled)
  warm        every image already in the encoder cache: no decoder, no tower
Medians over --repeats rounds, the modes alternating round by round (so a change in the
machine's load falls on all of them), after one untimed request.

Usage: python benchmarks/bench_multimodal.py [--concurrency 1,4,16] [--repeats 2]
           [--text-layers 8] [--vision-layers 12] [--tokens-per-step 256]
"""

from __future__ import annotations

import argparse
import io
import json
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models

from llm_runner_svc.engines import create_vision
from llm_runner_svc.engines.numpy_engine import NumpyEngine
from llm_runner_svc.models import load_model
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve
from llm_runner_svc.runtime.encoder_cache import EncoderCache
from llm_runner_svc.stage import MediaItem, StageRequest
from llm_runner_svc.stage.images import ImageEncoder
from llm_runner_svc.stage.limits import RequestLimits
from llm_runner_svc.stage.visual_pruning import PruningConfig

IMAGE_TOKEN = 3
TEXT = 24  # text tokens around the image


def build(path: Path, text_layers: int, vision_layers: int) -> None:
    vision = transformers.CLIPVisionConfig(hidden_size=384, intermediate_size=1536,
                                           num_hidden_layers=vision_layers,
                                           num_attention_heads=6, image_size=224,
                                           patch_size=16)
    text = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                    num_hidden_layers=text_layers, num_attention_heads=9,
                                    num_key_value_heads=3, max_position_embeddings=2048,
                                    tie_word_embeddings=True)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                   image_token_index=IMAGE_TOKEN)
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(str(path))
    vocab = {f"t{i}": i for i in range(64)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True, "image_mean": [0.48, 0.46, 0.41],
        "image_std": [0.27, 0.26, 0.28]}))


def png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (240, 320, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def round_ms(rt: InferenceRuntime, encoder: ImageEncoder, images: list[bytes],
             prompt: list[int]) -> tuple[list[float], float]:
    """Image-to-first-token ms of each request, and the encoder's ms in all, for one round
    of len(images) requests arriving at once."""
    ready: queue.Queue[tuple[int, Any]] = queue.Queue()
    encoder_ms = [0.0]
    t0 = time.perf_counter()

    def admit() -> None:
        for i, data in enumerate(images):
            req = StageRequest(f"r{i}", token_ids=tuple(prompt),
                               media=(MediaItem("image/png", data),))
            adm = encoder.admit(req, prompt)
            encoder_ms[0] += adm.media.encoder_ms
            ready.put((i, adm))

    worker = threading.Thread(target=admit)
    worker.start()
    first: dict[str, float] = {}
    sampling = resolve(rt.config.sampling, temperature=0.0, max_new_tokens=1)
    while len(first) < len(images):
        while not ready.empty():
            i, adm = ready.get()
            rt.submit(GenerationRequest(f"r{i}", list(adm), sampling, ignore_eos=True,
                                        embeds=adm.embeds))
        if not rt.has_work:
            time.sleep(0.0005)
            continue
        for ev in rt.step():
            if ev.token_ids and ev.request_id not in first:
                first[ev.request_id] = (time.perf_counter() - t0) * 1000.0
    worker.join()
    return list(first.values()), encoder_ms[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--text-layers", type=int, default=8)
    ap.add_argument("--vision-layers", type=int, default=12)
    ap.add_argument("--tokens-per-step", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.text_layers, args.vision_layers)
        model = load_model(tmp)
    assert model.vision is not None
    vc = model.vision.config
    prompt = [1, *range(10, 10 + TEXT // 2), IMAGE_TOKEN, *range(40, 40 + TEXT // 2)]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rt = InferenceRuntime(NumpyEngine(model.config, model.weights), model.tokenizer,
                          RuntimeConfig(max_batch=max(concurrency), max_seq=512,
                                        max_tokens_per_step=args.tokens_per_step))
    rt.preallocate()
    tower = create_vision(rt.engine, model.vision)
    print(f"model: CLIP tower {vc.num_layers} layers x {vc.hidden_size} at {vc.image_size} px "
          f"({vc.tokens_per_image} image tokens), decoder {model.config.num_layers} layers x "
          f"{model.config.hidden_size}; prompt {len(prompt) - 1} text + "
          f"{vc.tokens_per_image} image tokens; {args.tokens_per_step} tokens per step")
    # one untimed request first: BLAS threads, page faults of the weights, first-call costs
    round_ms(rt, ImageEncoder(model, tower, RequestLimits()), [png(10_000)], prompt)
    print("| concurrency | mode | image tokens prefilled | image-to-first-token ms (median) "
          "| slowest ms | encoder ms per image | vs cold |")
    print("|---|---|---|---|---|---|---|")
    seed = 0
    modes = {"cold": (None, None), "pruned": (None, PruningConfig(0.5, 1, 4, 4)),
             "warm": (EncoderCache(1 << 30), None)}
    encoders = {m: ImageEncoder(model, tower, RequestLimits(), cache, pruning)
                for m, (cache, pruning) in modes.items()}
    for c in concurrency:
        samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode, encoder in encoders.items():  # modes alternate: load drifts hit all
                images = [png(seed + i) for i in range(c)]
                seed += c
                if mode == "warm":
                    round_ms(rt, encoder, images, prompt)  # fills the cache, untimed
                times, encoder_ms = round_ms(rt, encoder, images, prompt)
                samples[mode].append((statistics.median(times), max(times), encoder_ms / c))
        base = statistics.median(t[0] for t in samples["cold"])
        for mode, rows in samples.items():
            pruning = modes[mode][1]
            kept = vc.tokens_per_image if pruning is None else pruning.num_kept(
                vc.tokens_per_image)
            med = statistics.median(t[0] for t in rows)
            slow = statistics.median(t[1] for t in rows)
            enc_ms = statistics.median(t[2] for t in rows)
            print(f"| {c} | {mode} | {kept} | {med:.0f} | {slow:.0f} | {enc_ms:.0f} | "
                  f"{med / base:.2f}x |", flush=True)
    rt.close()


if __name__ == "__main__":
    main()
