"""`dockrl serve`'s app (serve/) over a tiny model, a real uvicorn server on a loopback port and the real `openai`
client: greedy answers and their log-probs equal the engine's, concurrent requests share engine steps, the key
is checked, limits hold."""

import asyncio

import openai
import pytest

from dockrl.engines.rollout.rollout_engine import RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models.hf import load_model
from dockrl.models.tokenizer import Tokenizer
from dockrl.serve.model_server import Background, ServeSettings, build_app

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model):
    app, loop, _ = build_app(
        ServeSettings(model=str(tiny_model), api_key=KEY, max_tokens=12, max_batch_size=8)
    )
    running = Background(app)
    yield f"{running.url}/v1", loop
    running.stop()
    loop.close()


def _greedy(tiny_model, prompt_ids, max_new_tokens):
    tokenizer = Tokenizer.from_dir(tiny_model)
    model = load_model(str(tiny_model)).eval()
    engine = RolloutEngine(model, num_slots=1, max_seq_len=model.args.max_position_embeddings, pad_token_id=0)
    from dockrl.engines.rollout.rollout_engine import Request

    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    engine.add(
        Request(
            prompt_ids,
            [0],
            SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stops),
            tag=0,
        )
    )
    (done,) = [c for c in engine.run()]
    return done.generation


def test_chat_answers_are_the_engines_greedy_tokens_with_their_logprobs(server, tiny_model):
    url, _ = server
    client = openai.OpenAI(base_url=url, api_key=KEY)
    reply = client.chat.completions.create(
        model="anything",
        messages=[{"role": "user", "content": "What is 3+4?"}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
    )
    choice = reply.choices[0]
    ids, prompt_ids = choice.model_extra["token_ids"], reply.model_extra["prompt_token_ids"]
    expected = _greedy(tiny_model, prompt_ids, 8)
    assert ids == expected.token_ids.tolist()
    # the same engine code computes both in fp32 on one thread: equal
    assert [c.logprob for c in choice.logprobs.content] == expected.logprobs.tolist()
    assert reply.usage.completion_tokens == len(ids) <= 8
    text = client.completions.create(model="x", prompt=prompt_ids, temperature=0, max_tokens=8, logprobs=1)
    assert text.choices[0].model_extra["token_ids"] == ids
    assert text.choices[0].logprobs.token_logprobs == expected.logprobs.tolist()


def test_concurrent_requests_share_engine_steps(server):
    url, loop = server
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY)

    async def ask(i):
        return await client.completions.create(
            model="x", prompt=f"{i} plus {i}", temperature=1.0, max_tokens=12, seed=i
        )

    async def all_of():
        return await asyncio.gather(*(ask(i) for i in range(8)))

    before = loop.steps
    replies = asyncio.run(all_of())
    tokens = sum(r.usage.completion_tokens for r in replies)
    assert len(replies) == 8 and all(r.usage.completion_tokens <= 12 for r in replies)
    # one request at a time takes one step per token; together they share steps
    assert loop.steps - before < tokens


def test_the_key_and_the_limits_are_checked(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong").models.list()
    client = openai.OpenAI(base_url=url, api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["model"]
    capped = client.completions.create(model="x", prompt="hi", max_tokens=500, temperature=1.0, seed=1)
    assert capped.usage.completion_tokens <= 12
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], n=2)


def test_a_long_prompt_gets_the_room_it_leaves_and_the_server_goes_on(server, tiny_model):
    """max_seq_len = the tiny model's 512 positions: a 509-token prompt without max_tokens gets at most 3
    tokens (not the engine's refusal, which once killed the engine thread); a 512-token prompt and an id
    outside the vocabulary are 400s; the server answers after each."""
    url, _ = server
    client = openai.OpenAI(base_url=url, api_key=KEY)
    args = load_model(str(tiny_model)).args
    positions, vocab = args.max_position_embeddings, args.vocab_size
    assert positions == 512
    long = client.completions.create(model="x", prompt=[5] * (positions - 3), temperature=0)
    assert long.usage.prompt_tokens == positions - 3 and 1 <= long.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="x", prompt=[5] * positions, temperature=0)
    assert error.value.code == "context_length_exceeded" and "at most 511" in error.value.message
    with pytest.raises(openai.BadRequestError, match=f"outside the vocabulary \\[0, {vocab}\\)"):
        client.completions.create(model="x", prompt=[5, vocab], temperature=0)
    after = client.completions.create(model="x", prompt=[5, 6], temperature=0, max_tokens=2)
    assert after.usage.completion_tokens <= 2
