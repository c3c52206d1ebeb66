"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, in vLLM's shapes: the served
model's own tokenizer (the stage's, through the orchestrator's Tokenize and Detokenize), for
clients that count or cut prompts themselves (lm-eval's `tokenizer_backend=remote`, say).

    POST /tokenize {model?, prompt | messages, add_special_tokens?}
        -> {count, max_model_len, tokens, token_strs: null}
    POST /detokenize {model?, tokens} -> {prompt}
    GET /tokenizer_info -> {tokenizer_class, model_max_length, vocab_size, bos_token,
                            eos_token, chat_template, ...}

`model` may be left out while the deployment serves one model. A text prompt gets the model's
BOS where the model expects one unless `add_special_tokens` is false (vLLM's default for
text); a conversation is rendered by the chat template with its generation prompt, so its
ids are the ones a chat request's prompt holds (`add_special_tokens` true and
`add_generation_prompt` false are refused for it, naming the field).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.errors import InvalidArgument
from services.gateway.call import MAX_TOKEN_ID, BadField, Call, messages_of
from services.gateway.handlers import UPSTREAM, body_of
from services.gateway.upstream import Upstream


async def tokenize(request: web.Request) -> web.Response:
    body = await _object(request)
    upstream = request.app[UPSTREAM]
    model = await _model(upstream, body)
    add = body.get("add_special_tokens")
    if add is not None and not isinstance(add, bool):
        raise BadField("add_special_tokens", "add_special_tokens must be true or false")
    if body.get("return_token_strs") not in (None, False):
        raise BadField("return_token_strs", "return_token_strs is not supported")
    if "messages" in body:
        if "prompt" in body:
            raise BadField("prompt", "send prompt or messages, not both")
        if add:
            raise BadField("add_special_tokens", "a conversation's special tokens are its "
                           "chat template's: add_special_tokens must be false")
        if body.get("add_generation_prompt") not in (None, True):
            raise BadField("add_generation_prompt", "the chat template's generation prompt "
                           "is always added")
        images: list[tuple[str, bytes]] = []
        call = Call(kind="chat", model=model, messages=messages_of(body["messages"], images))
        if images:
            raise BadField("messages", "images cannot be tokenized on their own")
        tokens = await upstream.tokenize(model, call, add_special_tokens=False)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadField("prompt", "prompt must be a string (or send messages)")
        tokens = await upstream.tokenize(model, Call(kind="completion", model=model,
                                                     text=prompt),
                                         add_special_tokens=add is not False)
    return web.json_response({"count": len(tokens.token_ids), "max_model_len": tokens.max_seq,
                              "tokens": list(tokens.token_ids), "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    body = await _object(request)
    upstream = request.app[UPSTREAM]
    model = await _model(upstream, body)
    ids = body.get("tokens")
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t <= MAX_TOKEN_ID for t in ids)):
        raise BadField("tokens", "tokens must be a list of token ids in [0, 2^31)")
    return web.json_response({"prompt": await upstream.detokenize(model, ids)})


async def tokenizer_info(request: web.Request) -> web.Response:
    upstream = request.app[UPSTREAM]
    model = await _model(upstream, {})
    # the facts come with any prompt's ids (an empty prompt is malformed)
    facts = await upstream.tokenize(model, Call(kind="completion", model=model, text="a"),
                                    add_special_tokens=False)
    return web.json_response({
        "tokenizer_class": "llm-runner-svc", "name_or_path": model, "model": facts.model,
        "model_max_length": facts.max_seq, "vocab_size": facts.vocab_size,
        "bos_token": facts.bos_token or None, "eos_token": facts.eos_token or None,
        "chat_template": facts.chat_template or None})


async def _object(request: web.Request) -> dict[str, Any]:
    body = await body_of(request)
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


async def _model(upstream: Upstream, body: dict[str, Any]) -> str:
    """The model named, checked; or the only one served when none is named."""
    model = body.get("model")
    if model is None:
        models = await upstream.models()
        if len(models) != 1:
            raise BadField("model", f"model is required: this deployment serves "
                           f"{', '.join(models) or 'no text model'}")
        return models[0]
    if not isinstance(model, str):
        raise BadField("model", "model must be a string")
    await upstream.check_model(model)
    return model
