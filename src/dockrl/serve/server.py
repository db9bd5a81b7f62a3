"""The OpenAI-compatible HTTP app (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, a bearer key.

```
 request ─ key (constant-time compare) ─ check and render (openai_api.py) ─▶ await generate(ids, sampling)
         ◀─ response (openai_api.py), or {"error": ...} with its status
```

`generate` is whatever samples: `dockrl serve`'s EngineLoop over a model directory (engine_loop.py), or a run's
rollout through an agent host (agent_host.py). The app knows nothing of engines. Every route is also served under
`/s/{session}/v1/...` (one agent sample's base URL): there `sessions` (a SessionHooks) may render a chat
itself (an agent host keeps the ids sampled for earlier turns), sees each answer, and is told when the request
ends, answered or not. A request's prompt and completion fit in `max_seq_len`
tokens: a prompt that leaves no room is a 400 (`context_length_exceeded`), and max_tokens is lowered to the room
the prompt leaves (after the `max_tokens` cap). A ValueError from `generate` is the request's fault (400), any
other error the server's (500); both reach the client in OpenAI's shape.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

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

Generate = Callable[[list[int], Sampling, str | None], Awaitable[Sampled]]  # (prompt ids, sampling, session)
logger = logging.getLogger(__name__)


class SessionHooks(Protocol):
    """What the app asks of whoever keeps sessions (`/s/{session}/v1/...` requests)."""

    def render(self, session: str, messages: list[dict[str, Any]], tools: list | None) -> list[int] | None:
        """The chat's prompt ids, or None to render it plainly; raises ApiError to refuse the request."""
        ...

    def answered(
        self, session: str, prompt_ids: list[int], sampled: Sampled, text: str, reply: dict[str, Any]
    ) -> None:
        """The request was answered: `text` the message as returned, `reply` the response's first choice."""
        ...

    def release(self, session: str) -> None:
        """The request ended, answered or not."""
        ...


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
    sessions: SessionHooks | None = None,
    temperature: float | None = None,
) -> FastAPI:
    """The app serving `generate` (module docstring); `tokenizer` renders chats and decodes ids. `max_seq_len`:
    prompt + completion tokens of one request (the engine's cache length); `vocab_size`: prompt ids given as
    ids must lie in [0, vocab_size). Every route is also served under `/s/{session}/v1/...`: a client whose base
    URL names a session (one agent sample) has its requests go through `sessions` (module docstring). With
    `temperature`, every request samples at it, whatever it asks (held-out evaluation: 0, greedy)."""
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

    def forced(sampling: Sampling) -> Sampling:
        if temperature is None:
            return sampling
        return dataclasses.replace(sampling, temperature=temperature, top_p=1.0)

    async def sampled_for(ids: list[int], sampling: Sampling, session: str | None) -> Sampled:
        try:
            return await generate(ids, sampling, session)
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
        sampling = forced(chat_sampling(body, max_tokens))
        messages = chat_messages(body, family)
        tools = body.tools or None
        hooks = sessions if session is not None else None
        try:
            prompt_ids = hooks.render(session, messages, tools) if hooks is not None else None  # type: ignore[arg-type]
            if prompt_ids is None:
                prompt_ids = tokenizer.encode(render_chat(messages, tools))
            sampled = await sampled_for(prompt_ids, within_limits(prompt_ids, sampling, "messages"), session)
            message, tokens = message_of(sampled, sampling.stop)
            parse_tools = bool(body.tools) and body.tool_choice != "none"
            reply = chat_response(
                body.model, prompt_ids, sampled, message, family, tokens, body.logprobs, parse_tools
            )
            if hooks is not None:
                hooks.answered(session, prompt_ids, sampled, message, reply["choices"][0]["message"])  # type: ignore[arg-type]
            return reply
        finally:
            if hooks is not None:
                hooks.release(session)  # type: ignore[arg-type]

    def render_chat(messages: list[dict[str, Any]], tools: list | None) -> str:
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        # jinja's TemplateError (the template's raise_exception), or a field the template reads is absent
        except Exception as exc:
            raise ApiError(
                400, f"the model's chat template cannot render this request: {exc}", "messages"
            ) from exc

    async def completions(request: Request, session: str | None = None) -> dict[str, Any]:
        authorized(request)
        body = _parsed(CompletionRequest, await _json(request))
        sampling = forced(check_common(body, max_tokens, body.max_tokens))
        prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty; a prompt needs at least one token", "prompt")
        outside = [i for i in prompt_ids if not 0 <= i < vocab_size]
        if outside:
            raise ApiError(
                400, f"prompt token id {outside[0]} is outside the vocabulary [0, {vocab_size})", "prompt"
            )
        hooks = sessions if session is not None else None
        try:
            sampled = await sampled_for(prompt_ids, within_limits(prompt_ids, sampling, "prompt"), session)
            text, tokens = message_of(sampled, sampling.stop)
            reply = completion_response(
                body.model, prompt_ids, sampled, text, tokens, body.logprobs is not None
            )
            if hooks is not None:
                hooks.answered(session, prompt_ids, sampled, text, reply["choices"][0])  # type: ignore[arg-type]
            return reply
        finally:
            if hooks is not None:
                hooks.release(session)  # type: ignore[arg-type]

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
