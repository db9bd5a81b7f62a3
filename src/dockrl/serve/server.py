"""The OpenAI-compatible HTTP app (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, a bearer key.

```
 request ─ key (constant-time compare) ─ check and render (openai_api.py) ─▶ await generate(ids, sampling)
         ◀─ response (openai_api.py), or {"error": ...} with its status
```

`generate` is whatever samples: `dockrl serve`'s EngineLoop over a model directory (engine_loop.py), or, later,
a run's rollout. The app knows nothing of engines.
"""

from __future__ import annotations

import hmac
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
    max_prompt_tokens: int,
    stop_token_ids: list[int],
    record: Record | None = None,
) -> FastAPI:
    """The app serving `generate` (module docstring); `tokenizer` renders chats and decodes ids. Every route is
    also served under `/s/{session}/v1/...`: a client whose base URL names a session (one agent sample) has each
    answered request passed to `record`."""
    app = FastAPI(title="dockrl", docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def prompt_checked(ids: list[int]) -> list[int]:
        if len(ids) + 1 > max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this model serves at most {max_prompt_tokens - 1}",
                "messages",
            )
        return ids

    def message_of(sampled: Sampled) -> tuple[str, list[str]]:
        ids = sampled.token_ids
        body = ids[:-1] if ids and ids[-1] in stop_token_ids else ids
        tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return tokenizer.decode(body, skip_special_tokens=False), tokens

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def models(request: Request) -> dict[str, Any]:
        authorized(request)
        return models_response(model_name)

    async def chat(request: Request, session: str | None = None) -> dict[str, Any]:
        authorized(request)
        body = _parsed(ChatRequest, await _json(request))
        sampling = chat_sampling(body, max_tokens)
        messages = chat_messages(body, family)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=body.tools or None)
        prompt_ids = prompt_checked(tokenizer.encode(text))
        sampled = await generate(prompt_ids, sampling)
        message, tokens = message_of(sampled)
        if record is not None and session is not None:
            record(session, prompt_ids, sampled, message)
        return chat_response(body.model, prompt_ids, sampled, message, family, tokens, body.logprobs)

    async def completions(request: Request, session: str | None = None) -> dict[str, Any]:
        authorized(request)
        body = _parsed(CompletionRequest, await _json(request))
        sampling = check_common(body, max_tokens, body.max_tokens)
        ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        prompt_ids = prompt_checked(ids)
        sampled = await generate(prompt_ids, sampling)
        text, tokens = message_of(sampled)
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
