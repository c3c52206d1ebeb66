"""llm_runner_svc: the LlmRunner stage, its inference runtime, engines and model loaders."""

__version__ = "0.1.0"
