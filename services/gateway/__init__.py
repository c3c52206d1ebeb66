"""The OpenAI-compatible HTTP gateway: `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health` and `/metrics` over aiohttp, each generation one `Orchestrator.Generate` call over
gRPC; and vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info` over the orchestrator's Tokenize
and Detokenize.

It talks to the orchestrator only (never to a stage), holds no model and no tokenizer: the chat
template, tokenization and sampling stay on the stages. Modules: `call.py` (an HTTP body -> a
Call, malformed input refused there, with `constraints.py`, `tools.py` and `messages.py`),
`runs.py` (the Generate calls of a request's choices), `answers.py` (each choice, with
`logprobs.py` and `tool_stream.py`), `shapes.py` (OpenAI-shaped answers, chunks and errors),
`upstream.py` (the gRPC side), `handlers.py` (routes and server-sent events), `tokens.py` (the
tokenizer routes), `middleware.py` (trace, metrics, errors per HTTP request), `server.py`
(config and process).
"""
