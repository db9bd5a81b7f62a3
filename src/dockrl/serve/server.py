"""The OpenAI-compatible HTTP app (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, a bearer key.

```
 request ─ key (constant-time compare) ─ check and render (openai_api.py) ─▶ await generate(ids, sampling)
         ◀─ response (openai_api.py), or {"error": ...} with its status
```

`generate` is whatever samples: `dockrl serve`'s EngineLoop over a model directory (engine_loop.py), or, later,
a run's rollout. The app knows nothing of engines. A request's prompt and completion fit in `max_seq_len`
tokens: a prompt that leaves no room is a 400 (`context_length_exceeded`), and max_tokens is lowered to the room
the prompt leaves (after the `max_tokens` cap). A ValueError from `generate` is the request's fault (400), any
other error the server's (500); both reach the client in OpenAI's shape.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from dockrl.serve.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampled,
    Sampling,
    chat_messages,
    chat_response,
    chat_sampling,
    check_common,
    completion_response,
    models_response,
)

Generate = Callable[[list[int], Sampling], Awaitable[Sampled]]
logger = logging.getLogger(__name__)
# (session, prompt ids, what was sampled, its text): a session's requests as they are answered
Record = Callable[[str, list[int], Sampled, str], None]


def make_app(
    generate: Generate,
    tokenizer: Any,
    *,
    family: str,
    api_key: str,
    model_name: str,
    max_tokens: int,
    max_seq_len: int,
    vocab_size: int,
    stop_token_ids: list[int],
    record: Record | None = None,
) -> FastAPI:
    """The app serving `generate` (module docstring); `tokenizer` renders chats and decodes ids. `max_seq_len`:
    prompt + completion tokens of one request (the engine's cache length); `vocab_size`: prompt ids given as
    ids must lie in [0, vocab_size). Every route is also served under `/s/{session}/v1/...`: a client whose base
    URL names a session (one agent sample) has each answered request passed to `record`."""
    app = FastAPI(title="dockrl", docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def within_limits(ids: list[int], sampling: Sampling, param: str) -> Sampling:
        room = max_seq_len - len(ids)
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this server takes at most {max_seq_len - 1} (max_seq_len="
                f"{max_seq_len} tokens of prompt and completion together)",
                param,
                code="context_length_exceeded",
            )
        return dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room))

    async def sampled_for(ids: list[int], sampling: Sampling) -> Sampled:
        try:
            return await generate(ids, sampling)
        except ValueError as exc:  # the engine refused the request (it names the limit)
            raise ApiError(400, str(exc), "messages") from exc

    def message_of(sampled: Sampled, stop: list[str]) -> tuple[str, list[str]]:
        """(the text as OpenAI returns it: without the stop token, cut before a stop string that ended it;
        each sampled token's text). `token_ids` keep every sampled id."""
        ids = sampled.token_ids
        body = ids[:-1] if ids and ids[-1] in stop_token_ids else ids
        tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        text = tokenizer.decode(body, skip_special_tokens=False)
        found = [at for at in (text.find(s) for s in stop if s) if at >= 0]
        return (text[: min(found)] if found else text), tokens

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def server_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("dockrl serve: a request failed")
        return JSONResponse(ApiError(500, f"the server failed: {error}").body(), status_code=500)

    async def models(request: Request) -> dict[str, Any]:
        authorized(request)
        return models_response(model_name)

    async def chat(request: Request, session: str | None = None) -> dict[str, Any]:
        authorized(request)
        body = _parsed(ChatRequest, await _json(request))
        sampling = chat_sampling(body, max_tokens)
        messages = chat_messages(body, family)
        tools = body.tools or None
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        # jinja's TemplateError (the template's raise_exception), or a field the template reads is absent
        except Exception as exc:
            raise ApiError(
                400, f"the model's chat template cannot render this request: {exc}", "messages"
            ) from exc
        prompt_ids = tokenizer.encode(text)
        sampled = await sampled_for(prompt_ids, within_limits(prompt_ids, sampling, "messages"))
        message, tokens = message_of(sampled, sampling.stop)
        if record is not None and session is not None:
            record(session, prompt_ids, sampled, message)
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        return chat_response(
            body.model, prompt_ids, sampled, message, family, tokens, body.logprobs, parse_tools
        )

    async def completions(request: Request, session: str | None = None) -> dict[str, Any]:
        authorized(request)
        body = _parsed(CompletionRequest, await _json(request))
        sampling = check_common(body, max_tokens, body.max_tokens)
        prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty; a prompt needs at least one token", "prompt")
        outside = [i for i in prompt_ids if not 0 <= i < vocab_size]
        if outside:
            raise ApiError(
                400, f"prompt token id {outside[0]} is outside the vocabulary [0, {vocab_size})", "prompt"
            )
        sampled = await sampled_for(prompt_ids, within_limits(prompt_ids, sampling, "prompt"))
        text, tokens = message_of(sampled, sampling.stop)
        if record is not None and session is not None:
            record(session, prompt_ids, sampled, text)
        return completion_response(body.model, prompt_ids, sampled, text, tokens, body.logprobs is not None)

    for prefix in ("", "/s/{session}"):
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
        app.add_api_route(f"{prefix}/v1/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/completions", completions, methods=["POST"])
    return app


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise ApiError(400, "the body is not JSON") from None


def _parsed(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"{field}: {first.get('msg')}", field or None) from None
