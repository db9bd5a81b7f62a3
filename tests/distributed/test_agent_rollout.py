"""Agent functions in a rollout (serve/agent_host.py, engines/rollout/multi_turn.py): a real uvicorn server and the
`openai` client in front of dockrl's engine. Per token: each request's prompt is the trajectory so far, each
answer's sampled ids and log-probs sit where loss_mask is 1, the row's prompt is the agent's first request; an
agent that rewrites its history starts the trajectory over (prefix_breaks); an agent's failure, hang or excess
ends its sample only."""

import asyncio
import math

import pytest
import torch

from dockrl.engines.rollout.multi_turn import ChatDelta, TurnLimits, run_trajectories
from dockrl.engines.rollout.rollout_engine import RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.envs.host import LocalEnvs
from dockrl.models.hf import load_model
from dockrl.models.tokenizer import Tokenizer, stop_token_ids
from dockrl.serve import agent_host
from dockrl.serve.agent_host import AgentHost, _Session

pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
SEEN: dict[str, list[tuple[list[int], list[int], list[float]]]] = {}  # prompt -> (prompt ids, ids, log-probs)


async def three_turns(client, row):
    """Three requests, each sending back the answer as the `openai` client returned it, then a tool result."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for k in range(3):
        reply = await client.chat.completions.create(
            model="any", messages=messages, tools=TOOLS, max_tokens=5, logprobs=True
        )
        choice = reply.choices[0]
        logprobs = [t.logprob for t in choice.logprobs.content]
        SEEN.setdefault(row["prompt"], []).append(
            (reply.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], logprobs)
        )
        messages += [choice.message, {"role": "tool", "tool_call_id": "c", "content": f"result {k}"}]
    return 0.5


async def rewrites_history(client, row):
    """Two requests; the second forgets the first exchange (a summarising agent): a prefix break."""
    first = await client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=4
    )
    SEEN.setdefault(row["prompt"], []).append((first.model_extra["prompt_token_ids"], [], []))
    messages = [{"role": "user", "content": "Start again: " + row["prompt"]}]
    second = await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    SEEN[row["prompt"]].append(
        (second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"], [])
    )
    return 1.0


async def misbehaves(client, row):
    """By prompt: raises, hangs past its call limit, asks once too often, or sends a malformed request."""
    import openai

    kind = row["prompt"]
    if kind == "raise":
        await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        raise RuntimeError("the agent broke")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "malformed":
        try:
            await client.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
            )
        except openai.BadRequestError as exc:
            SEEN["malformed"] = [([exc.status_code], [], [])]
        return 0.25
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(10):  # the run answers 2 requests per sample (env.max_turns), then cancels the agent
        reply = await client.chat.completions.create(model="any", messages=messages, max_tokens=2)
        SEEN.setdefault("too_many", []).append(([], reply.choices[0].model_extra["token_ids"], []))
        messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
    return 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dockrl.models.tiny import make_tiny

    path = make_tiny(
        tmp_path_factory.mktemp("agent") / "model", family="qwen2", hidden_size=64, num_layers=2, seed=0
    )
    return path, Tokenizer.from_dir(path), load_model(path).eval()


def _host(tiny, solve) -> AgentHost:
    _, tokenizer, model = tiny
    eos = stop_token_ids(tokenizer.eos_token_id)
    return AgentHost(
        solve,
        tokenizer,
        "qwen2",
        stop_token_ids=eos,
        vocab_size=model.args.vocab_size,
        max_seq_len=512,
        max_tokens=64,
    )


def _run(tiny, solve, prompts, limits, sampled=None):
    _, tokenizer, model = tiny
    engine = RolloutEngine(model, num_slots=8, max_seq_len=512, pad_token_id=0, detokenize=tokenizer.decode)
    if sampled is not None:
        step = engine.step

        def recording_step():
            done = step()
            for c in done:
                sampled.setdefault(c.tag[c.sample], []).append(c.generation)
            return done

        engine.step = recording_step
    host = _host(tiny, solve)
    eos = stop_token_ids(tokenizer.eos_token_id)
    try:
        return run_trajectories(
            engine,
            [tokenizer.encode(p) for p in prompts],
            [{"prompt": p, "label": None} for p in prompts],
            params=SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=eos),
            groups_per_pull=8,
            row_seed=lambda row: 100 + row,
            envs=LocalEnvs(host),
            delta=ChatDelta(tokenizer, []),
            system_prompt=None,
            limits=limits,
        )
    finally:
        host.close()


def test_an_agents_requests_are_its_trajectory_token_for_token(tiny):
    SEEN.clear()
    prompts = ["What is 1+2?", "What is 3+4?", "What is 12*3?"]
    sampled: dict[int, list] = {}
    outs, stats = _run(tiny, three_turns, prompts, TurnLimits(4, 8, 400, 30.0), sampled)
    assert stats["env"]["turns"] == 9 and stats["env"]["prefix_breaks"] == 0 and stats["env"]["failed"] == 0
    assert stats["env"]["tool_calls"] == 6  # the tool results sent before the second and third requests
    for row, (prompt, out) in enumerate(zip(prompts, outs)):
        requests = SEEN[prompt]
        assert out["env_reward"] == 0.5 and out["env_failed"] == 0.0
        # The row's prompt is the agent's first request (tools rendered in), not the dataset's bare prompt.
        assert out["prompt_ids"].tolist() == requests[0][0]
        full = out["prompt_ids"].tolist() + out["response_ids"].tolist()
        mask, logprobs = out["loss_mask"].tolist(), out["rollout_logprobs"]
        policy = [i for i, m in enumerate(mask) if m == 1.0]
        at = 0
        for (prompt_ids, ids, client_logprobs), gen in zip(requests, sampled[row], strict=True):
            # each request's prompt is the trajectory so far; its answer the engine's sampled ids, trained
            assert full[: len(prompt_ids)] == prompt_ids
            start = len(prompt_ids) - len(out["prompt_ids"])
            assert ids == gen.token_ids.tolist() == full[len(prompt_ids) : len(prompt_ids) + len(ids)]
            assert policy[at : at + len(ids)] == list(range(start, start + len(ids)))
            assert torch.equal(logprobs[start : start + len(ids)], gen.logprobs)
            assert client_logprobs == gen.logprobs.tolist()  # what the client read is what the trainer gets
            at += len(ids)
        assert at == len(policy)  # nothing else is trained: the tool results and template tokens are masked
        assert all(logprobs[i] == 0.0 for i, m in enumerate(mask) if m == 0.0)


def test_an_agent_that_rewrites_its_history_starts_the_trajectory_over(tiny):
    SEEN.clear()
    outs, stats = _run(tiny, rewrites_history, ["What is 5-1?"], TurnLimits(4, 8, 400, 30.0))
    (first, _, _), (second, ids, _) = SEEN["What is 5-1?"]
    assert stats["env"]["prefix_breaks"] == 1 and stats["env"]["turns"] == 2
    out = outs[0]
    assert out["prompt_ids"].tolist() == second and out["response_ids"].tolist() == ids  # the last trajectory
    assert second[: len(first)] != first
    assert out["env_reward"] == 1.0


def test_sampled_ids_are_sent_back_never_retokenized(tiny, monkeypatch):
    """A continued chat's prompt holds the ids sampled for the assistant's answer even where the tokenizer would
    encode its text otherwise (here: one id per character); rendered afresh it would not."""
    _, tokenizer, _ = tiny
    host = _host(tiny, three_turns)
    try:
        text = "The answer is 42"
        chars = [i for c in text for i in tokenizer.encode(c)]
        assert tokenizer.decode(chars) == text and chars != tokenizer.encode(text)
        eos = tokenizer.encode("<|im_end|>")
        user = {"role": "user", "content": "What is 6*7?"}
        prompt = tokenizer.encode(tokenizer.apply_chat_template([user], add_generation_prompt=True))
        host.sessions["s"] = _Session(
            {},
            prompt=prompt,
            sampled=chars + eos,
            sampled_text=text,
            sampled_all=text + "<|im_end|>",
            seen=[user],
            rendered=[user],
            returned={"role": "assistant", "content": text},
        )
        chat = [user, {"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
        ids = host.render("s", chat, None)
        host.release("s")
        assert ids[: len(prompt) + len(chars) + 1] == prompt + chars + eos
        fresh = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
        assert tokenizer.decode(ids) == tokenizer.decode(fresh)  # the same text ...
        assert fresh[: len(prompt) + len(chars)] != prompt + chars  # ... but a re-tokenization loses the ids
        # An edited answer is another history: rendered afresh.
        edited = [
            user,
            {"role": "assistant", "content": "The answer is 41"},
            {"role": "user", "content": "Sure?"},
        ]
        assert host.render("s", edited, None) == tokenizer.encode(
            tokenizer.apply_chat_template(edited, add_generation_prompt=True)
        )
    finally:
        host.close()


def test_a_failing_hanging_or_excessive_agent_ends_its_sample_only(tiny):
    SEEN.clear()
    prompts = ["raise", "hang", "malformed", "too_many"]
    outs, stats = _run(tiny, misbehaves, prompts, TurnLimits(2, 8, 200, 1.0))
    failed = [o["env_failed"] for o in outs]
    assert failed == [1.0, 0.0, 0.0, 0.0]  # the raising agent's sample is failed
    assert stats["env"]["timeouts"] == 1  # the hanging one ran past its 1 s and was cut (truncated)
    assert SEEN["malformed"][0][0] == [400] and outs[2]["env_reward"] == 0.25  # a 400 the client understands
    # the third request is past env.max_turns=2: the trajectory ends truncated (the agent is cancelled)
    assert len(SEEN["too_many"]) == 2 and stats["env"]["truncated"] == 2 and math.isnan(outs[3]["env_reward"])
    assert sum(m == 1.0 for m in outs[3]["loss_mask"].tolist()) > 0  # its two answered turns are kept


def test_the_host_refuses_unknown_sessions_and_wrong_keys(tiny):
    import openai

    host = _host(tiny, three_turns)
    try:

        async def ask(key, session):
            client = openai.AsyncOpenAI(base_url=f"{host.url}/s/{session}/v1", api_key=key, max_retries=0)
            try:
                await client.chat.completions.create(
                    model="any", messages=[{"role": "user", "content": "hi"}]
                )
            finally:
                await client.close()

        with pytest.raises(openai.AuthenticationError):
            asyncio.run(ask("wrong", "nobody"))
        with pytest.raises(openai.NotFoundError):
            asyncio.run(ask(host.key, "nobody"))
        assert agent_host.START_S > 0
    finally:
        host.close()


def test_an_openai_agents_sdk_agent_runs_unchanged(tiny):
    """examples/agents/agents_sdk_calculator.py (the OpenAI Agents SDK's Runner over the client the host hands
    it) is served and recorded like a plain client's agent."""
    pytest.importorskip("agents")
    from pathlib import Path

    from dockrl.serve.agents import load_agent

    example = Path(__file__).parents[2] / "examples" / "agents" / "agents_sdk_calculator.py"
    solve = load_agent(f"{example}:solve")
    outs, stats = _run(tiny, solve, ["What is 12*34?", "What is 7*8?"], TurnLimits(3, 4, 200, 30.0))
    assert stats["env"]["failed"] == 0 and stats["env"]["turns"] >= 2
    for out in outs:
        assert out["env_failed"] == 0.0 and math.isnan(out["env_reward"])  # None: the reward functions score
        assert sum(out["loss_mask"].tolist()) > 0
        # the SDK rendered the calculator's schema into the request: the row's prompt is that request
        assert len(out["prompt_ids"]) > 40


def test_bench_agent_gives_the_same_tokens_both_ways():
    """`dockrl bench agent --quick`: the environment path and the endpoint path sample the same trajectories."""
    import argparse

    from dockrl.bench import agent as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    env_row, agent_row, _ = bench.run(parser.parse_args(["--quick"]))
    assert agent_row["same_tokens"] == "8/8" and agent_row["failed"] == env_row["failed"] == 0
    assert agent_row["turns"] == env_row["turns"] == 8 * 3 and agent_row["prefix_breaks"] == 0
