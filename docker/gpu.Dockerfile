# The runner for GPU nodes: the Python services with the torch engine (.[torch]) on a CUDA
# runtime base. deploy/k8s/overlays/gpu runs its runners from this image.
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY llm_runner_svc ./llm_runner_svc
COPY services ./services
COPY clients/python ./clients/python
COPY docker/compose ./docker/compose
RUN pip install ".[torch]"
EXPOSE 50050 50051 9100 9101
CMD ["llm-runner", "serve", "--host", "0.0.0.0", "--port", "50051"]
