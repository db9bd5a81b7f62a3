"""AgentHost: agent functions as a multi-turn rollout's environments, their model calls served over HTTP.

```
 rollout head rank (EnvCalls)             AgentHost (in an environment worker: workers/env.py)
   reset(row) ──────────────────────────▶ solve(client, row) starts; client: AsyncOpenAI at /s/<key>/v1
                                            the agent's request ─ rendered (chat template) ─┐
   ◀── Outcome(ok, ModelRequest(prompt ids, max_tokens, stop)) ────────────────────────────┘
   the engine samples the turn
   step(row, sampled ids + log-probs) ──▶ the open HTTP request is answered (text, tool_calls, log-probs)
                                            the agent's next request ─▶ Outcome(ok, ModelRequest), or
                                            solve returns r ─▶ Outcome(ok, Observation(done=True, reward=r))
   drop(row) ───────────────────────────▶ the agent is cancelled; a request it has open gets a 400
```

The host keeps EnvHost's contract (envs/host.py: `submit(key, RESET | STEP, argument, limit_s) -> Future` of an
Outcome, `drop`, `close`, `counts`), so the environment tier (TierEnvs), the tensor-parallel Lockstep and the
rollout's limits carry agents unchanged. Its server is the same FastAPI app as `dockrl serve` (server.py), bound
to the loopback interface with a key of its own: the agents it runs are its only clients.

Token in, token out. A chat request that repeats the session's last request's messages, then the assistant
message it was answered with (as the `openai` client hands it back), then new messages (tool results, the user's
next turn) has as its prompt the last prompt, the ids sampled for that answer, and the chat template's delta of the
new messages (envs/chat_delta.py ChatDelta): what was sampled is never re-tokenized. Any other chat (the
agent rewrote its history, changed its tools) is rendered afresh; its prompt then does not extend the trajectory,
and the rollout starts the sample's trajectory over (`env/prefix_breaks`). `/v1/completions` prompts are taken as
given (ids or text).

Limits. Each call may take `limit_s` of the agent's own time (env.call_timeout_s): RESET until the agent's first
request, STEP from the answer to its next request or its end; time a request waits on the engine is not the
agent's. A late agent answers `timeout` and is cancelled; one that raises answers `error`; either way only its
sample ends. One request at a time per sample: a second while one is open is a 409.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dockrl.envs.base import ModelRequest, Observation
from dockrl.envs.chat_delta import ChatDelta
from dockrl.envs.host import RESET, STEP, Outcome
from dockrl.serve.openai_api import ApiError, Sampled, Sampling, template_message
from dockrl.serve.server import make_app

START_S = 30.0  # how long the host's server may take to listen


@dataclass
class _Session:
    """One sample's agent: the rollout's open call, the agent's open request, and what was sampled so far."""

    row: dict[str, Any]
    call: Future | None = None  # the rollout's open call: answered by the agent's next request or its end
    call_started: float = 0.0
    timer: asyncio.TimerHandle | None = None
    answer: asyncio.Future | None = None  # the agent's open request, waiting for its sampled tokens
    task: asyncio.Task | None = None
    end: Outcome | None = None  # how the agent ended: the answer to any later call
    busy: bool = False  # a request is open
    tool_results: int = 0  # tool messages the open request added
    # token in, token out: the last request and its answer
    prompt: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    sampled_text: str = ""  # the answer as decoded without its stop token
    sampled_all: str = ""  # every sampled id decoded
    seen: list[dict[str, Any]] | None = (
        None  # the last chat's messages as the agent sent them (template form)
    )
    rendered: list[dict[str, Any]] = field(default_factory=list)  # the same with the sampled text for answers
    tools: list | None = None
    returned: dict[str, Any] | None = None  # the answer's message as the agent sends it back (template form)


class AgentHost:
    """Agent function `solve` run once per trajectory (module docstring). `tokenizer` renders chats (a dockrl
    Tokenizer or any with apply_chat_template, encode and decode); `family` the model's tool-call format;
    `max_tokens` caps a request's completion, `max_seq_len` its prompt and completion."""

    def __init__(
        self,
        solve: Any,
        tokenizer: Any,
        family: str,
        *,
        stop_token_ids: list[int],
        vocab_size: int,
        max_seq_len: int,
        max_tokens: int,
        model_name: str = "policy",
    ):
        self.solve, self.tokenizer, self.family = solve, tokenizer, family
        for name in (
            "httpx",
            "httpx2",
            "openai",
        ):  # a line per agent request at INFO: the run's log is not theirs
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        self.stop_token_ids = stop_token_ids
        self.key = secrets.token_urlsafe(24)
        self.sessions: dict[str, _Session] = {}
        self.counts = {
            "calls": 0,
            "timeouts": 0,
            "cancelled": 0,
            "errors": 0,
            "requests": 0,
            "abandoned_threads": 0,
        }
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="dockrl-agents", daemon=True).start()
        app = make_app(
            self._generate,
            tokenizer,
            family=family,
            api_key=self.key,
            model_name=model_name,
            max_tokens=max_tokens,
            max_seq_len=max_seq_len,
            vocab_size=vocab_size,
            stop_token_ids=stop_token_ids,
            sessions=self,
        )
        import openai  # noqa: F401  (before any call's clock starts: the agents' clients need it)
        import uvicorn

        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[listening]), self.loop)
        deadline = time.monotonic() + START_S
        while not self.server.started:  # bounded: a loopback server listens in well under a second
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent host's server did not start within {START_S:g} s")
            time.sleep(0.01)

    # ---- the rollout's side (any thread) ----------------------------------------------------------

    def submit(
        self, key: str, method: str, argument: Any, limit_s: float, tool_calls_left: int = 1 << 30
    ) -> Future:
        """RESET(row) starts the agent, STEP(sampled: {token_ids, logprobs, finish_reason}) answers its open
        request; the future's Outcome is the agent's next ModelRequest or how it ended."""
        assert method in (RESET, STEP), method
        future: Future = Future()
        self.loop.call_soon_threadsafe(self._submit, key, method, argument, limit_s, future)
        return future

    def drop(self, key: str) -> None:
        """Trajectory `key` ended: cancel its agent; a request it has open is refused."""
        self.loop.call_soon_threadsafe(self._drop, key)

    def close(self) -> None:
        """Cancel every agent and stop the server."""
        for key in list(self.sessions):
            self.drop(key)
        self.server.should_exit = True

    # ---- the host's loop --------------------------------------------------------------------------

    def _submit(self, key: str, method: str, argument: Any, limit_s: float, future: Future) -> None:
        if method == RESET:
            session = self.sessions[key] = _Session(dict(argument))
            self._open(session, future, limit_s)
            session.task = self.loop.create_task(self._run(key, session))
            return
        found = self.sessions.get(key)
        if found is None:
            _set(future, Outcome("error", error=f"no agent for trajectory {key!r} on this host"))
            return
        self._open(found, future, limit_s)
        if found.end is not None:
            self._answer(found, found.end)
        elif found.answer is None or found.answer.done():
            self._answer(found, Outcome("error", error="the agent has no request open to answer"))
        else:
            found.answer.set_result(
                Sampled(list(argument["token_ids"]), list(argument["logprobs"]), argument["finish_reason"])
            )

    def _open(self, session: _Session, future: Future, limit_s: float) -> None:
        session.call, session.call_started = future, time.perf_counter()
        session.timer = self.loop.call_later(limit_s, self._expire, session, future, limit_s)

    def _answer(self, session: _Session, outcome: Outcome) -> None:
        """Answer the rollout's open call (if any) with `outcome`."""
        future, session.call = session.call, None
        if session.timer is not None:
            session.timer.cancel()
            session.timer = None
        if future is None:
            return
        if outcome.kind in ("ok", "error") and not outcome.seconds:
            outcome = Outcome(
                outcome.kind, outcome.observation, outcome.error, time.perf_counter() - session.call_started
            )
        if _set(future, outcome):
            self.counts["calls"] += 1
            for kind, counter in (("timeout", "timeouts"), ("cancelled", "cancelled"), ("error", "errors")):
                self.counts[counter] += int(outcome.kind == kind)

    def _expire(self, session: _Session, future: Future, limit_s: float) -> None:
        if session.call is future:
            session.end = Outcome("timeout", seconds=limit_s)
            self._answer(session, session.end)
            if session.task is not None:
                session.task.cancel()

    def _drop(self, key: str) -> None:
        session = self.sessions.pop(key, None)
        if session is None:
            return
        if session.end is None:
            session.end = Outcome("cancelled")
        if session.answer is not None and not session.answer.done():
            session.answer.set_exception(
                ApiError(
                    400, "this sample has ended (a limit of the run, or the run itself)", code="sample_ended"
                )
            )
        if session.task is not None:
            session.task.cancel()
        self._answer(session, Outcome("cancelled"))

    async def _run(self, key: str, session: _Session) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=f"{self.url}/s/{key}/v1", api_key=self.key, max_retries=0)
        try:
            reward = await self.solve(client, dict(session.row))
            end = Outcome("ok", Observation(done=True, reward=None if reward is None else float(reward)))
        except asyncio.CancelledError:
            end = session.end or Outcome("cancelled")
        except Exception as exc:  # the agent's failure ends its sample, never the host
            end = Outcome("error", error=f"the agent raised {type(exc).__name__}: {exc}")
        finally:
            await client.close()
        if session.end is None:
            session.end = end
        self._answer(session, session.end)

    async def _generate(self, prompt_ids: list[int], sampling: Sampling, key: str | None) -> Sampled:
        """An agent's request (after render): becomes the answer to the rollout's open call, and waits for the
        tokens the rollout samples for it."""
        session = self.sessions.get(key) if key is not None else None
        if session is None or session.end is not None:
            raise ApiError(
                400, "this sample has ended (a limit of the run, or the run itself)", code="sample_ended"
            )
        if session.call is None:
            raise ApiError(
                409, "this sample has no turn open (one request at a time per sample)", code="busy"
            )
        self.counts["requests"] += 1
        session.answer = self.loop.create_future()
        request = ModelRequest(
            list(prompt_ids), sampling.max_tokens, tuple(sampling.stop), session.tool_results
        )
        self._answer(session, Outcome("ok", request))
        return await session.answer

    # ---- server.SessionHooks (on the loop) --------------------------------------------------------

    def render(self, key: str, messages: list[dict[str, Any]], tools: list | None) -> list[int] | None:
        """The chat's prompt ids: the last prompt, its answer's sampled ids and the delta of the new messages
        when the chat continues the last one, else rendered afresh (module docstring)."""
        session = self.sessions.get(key)
        if session is None:
            raise ApiError(
                404, f"no agent session {key!r} on this host (its sample ended)", code="sample_ended"
            )
        if session.busy:
            raise ApiError(409, "one request at a time per sample: wait for the open one", code="busy")
        session.busy = True
        seen = session.seen
        continues = (
            seen is not None
            and session.returned is not None
            and tools == session.tools
            and len(messages) > len(seen)
            and messages[: len(seen)] == seen
            and messages[len(seen)] == session.returned
        )
        if continues:
            assert seen is not None
            new = messages[len(seen) + 1 :]
            delta, _ = ChatDelta(self.tokenizer, tools or []).observation(
                session.rendered, session.sampled_text, session.sampled_all, new
            )
            ids = session.prompt + session.sampled + delta
            session.rendered = [
                *session.rendered,
                {"role": "assistant", "content": session.sampled_text},
                *new,
            ]
            session.tool_results = sum(m["role"] == "tool" for m in new)
        else:
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
            except Exception as exc:  # as server.py: the template cannot render this chat
                raise ApiError(
                    400, f"the model's chat template cannot render this request: {exc}", "messages"
                ) from exc
            ids = self.tokenizer.encode(text)
            before = sum(m["role"] == "tool" for m in seen or [])
            session.rendered = list(messages)
            session.tool_results = max(0, sum(m["role"] == "tool" for m in messages) - before)
        session.seen, session.tools = list(messages), tools
        return ids

    def answered(
        self, key: str, prompt_ids: list[int], sampled: Sampled, text: str, reply: dict[str, Any]
    ) -> None:
        session = self.sessions.get(key)
        if session is None:
            return
        ids = sampled.token_ids
        body = ids[:-1] if ids and ids[-1] in self.stop_token_ids else ids
        session.prompt, session.sampled = list(prompt_ids), list(ids)
        session.sampled_text = self.tokenizer.decode(body, skip_special_tokens=False)
        session.sampled_all = self.tokenizer.decode(ids, skip_special_tokens=False)
        chat = "message" not in reply and reply.get("role") == "assistant"
        session.returned = template_message(reply, 0, self.family) if chat else None
        if not chat:  # a completion: the next chat renders afresh
            session.seen = None

    def release(self, key: str) -> None:
        session = self.sessions.get(key)
        if session is not None:
            session.busy = False


def _set(future: Future, outcome: Outcome) -> bool:
    """Answer `future` unless it already has an answer; True when this one counted."""
    if future.done():
        return False
    future.set_result(outcome)
    return True


def agent_host(env: Any, model_path: str) -> AgentHost:
    """The AgentHost of a run's agent environment `env` (an EnvSpec naming an agent function) over the policy's
    tokenizer at `model_path`; completions capped by the trajectory's budget (the rollout applies
    rollout.max_new_tokens and the room left)."""
    from dockrl.envs.loader import agent_function
    from dockrl.models.config import read_config
    from dockrl.models.tokenizer import Tokenizer, stop_token_ids

    solve = agent_function(env.name, env.code, env.origin)
    if solve is None:
        raise ValueError(f"env.name={env.name!r} is not an agent function")
    args = read_config(model_path)
    tokenizer = Tokenizer.from_dir(model_path)
    return AgentHost(
        solve,
        tokenizer,
        args.family,
        stop_token_ids=stop_token_ids(tokenizer.eos_token_id, args.eos_token_id),
        vocab_size=args.vocab_size,
        max_seq_len=args.max_position_embeddings,
        max_tokens=env.max_response_tokens,
    )
