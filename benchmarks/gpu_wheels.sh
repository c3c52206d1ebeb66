#!/usr/bin/env bash
# The wheels the benchmarks/gpu_*.sh runners install on a GPU machine without network:
# what the project needs beyond what such a machine brings (torch, Triton, numpy, grpcio,
# protobuf, transformers), downloaded into .whl/ for its Python (PY, default 3.12) on
# x86_64 Linux. Run it from the repository root on a machine with network; carry .whl/
# to the GPU machine with the working tree.
#   GRPC: the GPU machine's grpcio, which the health and reflection services must match
#   (default 1.84.0); OTEL / OTEL_SEMCONV: the OpenTelemetry release pair (1.45.2 / 0.66b2).
set -euo pipefail
PY=${PY:-3.12}
GRPC=${GRPC:-1.84.0}
OTEL=${OTEL:-1.45.2}
OTEL_SEMCONV=${OTEL_SEMCONV:-0.66b2}
mkdir -p .whl
python3 -m pip download -q --dest .whl --only-binary=:all: --no-deps \
    --python-version "$PY" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform any \
    llguidance gguf tokenizers safetensors "grpcio-health-checking==$GRPC" "grpcio-reflection==$GRPC" \
    "opentelemetry-api==$OTEL" "opentelemetry-sdk==$OTEL" \
    "opentelemetry-exporter-otlp-proto-grpc==$OTEL" \
    "opentelemetry-exporter-otlp-proto-common==$OTEL" "opentelemetry-proto==$OTEL" \
    "opentelemetry-semantic-conventions==$OTEL_SEMCONV" googleapis-common-protos \
    importlib-metadata zipp prometheus-client tqdm pillow pyyaml typing-extensions \
    pytest pluggy iniconfig packaging pytest-timeout \
    jsonschema jsonschema-specifications referencing rpds-py attrs
du -sh .whl
