# The Python services (llm_runner_svc stage, orchestrator, HTTP gateway, llm-stage client) in
# one image.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY llm_runner_svc ./llm_runner_svc
COPY services ./services
COPY clients/python ./clients/python
COPY docker/compose ./docker/compose
RUN pip install .
EXPOSE 8000 50050 50051 9100 9101 9102
CMD ["llm-runner", "serve", "--host", "0.0.0.0", "--port", "50051"]
