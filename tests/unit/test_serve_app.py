"""serve/server.py's app in process (starlette's TestClient) over a fake `generate` and the tiny model's tokenizer:
tool calls go out as OpenAI `tool_calls` and come back in the family's text; a family without a tool-call
format still chats."""

import json

import pytest
from fastapi.testclient import TestClient

from dockrl.models.tokenizer import Tokenizer
from dockrl.serve.openai_api import Sampled
from dockrl.serve.server import make_app

KEY = "k"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
CALCULATOR = {"name": "calculator", "description": "exact", "parameters": {"properties": {"expression": {}}}}
TOOLS = [{"type": "function", "function": CALCULATOR}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_dir(tiny_model)


def _client(tokenizer, family, answer):
    """The app for `family` whose model always answers `answer` (then eos); `seen` gets each prompt's ids."""
    seen = []

    async def generate(prompt_ids, sampling, session):
        seen.append(prompt_ids)
        ids = tokenizer.encode(answer) + [tokenizer.eos_token_id]
        return Sampled(ids, [-1.0] * len(ids), "stop")

    app = make_app(
        generate,
        tokenizer,
        family=family,
        api_key=KEY,
        model_name="tiny",
        max_tokens=16,
        max_seq_len=512,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"}), seen


def test_a_tool_call_goes_out_as_tool_calls_and_comes_back_as_the_models_text(tokenizer):
    client, seen = _client(tokenizer, "qwen2", CALL)
    ask = [{"role": "user", "content": "What is 2*3?"}]
    reply = client.post("/v1/chat/completions", json={"model": "m", "messages": ask, "tools": TOOLS}).json()
    (choice,) = reply["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "2*3"}'}
    follow = [*ask, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "6"}]
    client.post("/v1/chat/completions", json={"model": "m", "messages": follow, "tools": TOOLS})
    # the second prompt holds the first one's sampled text (the eos ends the turn), then the tool's answer
    first_turn = tokenizer.decode(seen[0] + reply["choices"][0]["token_ids"], skip_special_tokens=False)
    assert tokenizer.decode(seen[1], skip_special_tokens=False).startswith(first_turn)
    untooled = client.post("/v1/chat/completions", json={"model": "m", "messages": ask}).json()
    assert untooled["choices"][0]["message"] == {"role": "assistant", "content": CALL}


def test_a_family_without_a_tool_call_format_chats_and_refuses_tools(tokenizer):
    client, _ = _client(tokenizer, "qwen3_moe", "Six.")
    ask = {"model": "m", "messages": [{"role": "user", "content": "What is 2*3?"}]}
    reply = client.post("/v1/chat/completions", json=ask)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Six."
    refused = client.post("/v1/chat/completions", json={**ask, "tools": TOOLS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert json.loads(refused.text)["error"]["type"] == "invalid_request_error"


def test_a_request_the_chat_template_refuses_is_a_400(tokenizer):
    client, _ = _client(tokenizer, "qwen2", "Six.")
    # the tiny template reads each tool's description (OpenAI's is optional) and refuses unknown roles
    no_description = [
        {"type": "function", "function": {"name": "calculator", "parameters": {"properties": {}}}}
    ]
    ask = [{"role": "user", "content": "hi"}]
    reply = client.post("/v1/chat/completions", json={"model": "m", "messages": ask, "tools": no_description})
    assert reply.status_code == 400 and "chat template cannot render" in reply.json()["error"]["message"]


def test_a_stop_string_ends_the_text_before_it_and_the_ids_keep_every_sampled_token(tokenizer):
    client, _ = _client(tokenizer, "qwen2", "Six. END more")
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["END", "never"]}
    (choice,) = client.post("/v1/chat/completions", json=ask).json()["choices"]
    assert choice["message"]["content"] == "Six. "
    assert choice["token_ids"] == tokenizer.encode("Six. END more") + [tokenizer.eos_token_id]
    prompt = {"model": "m", "prompt": "hi", "stop": "more"}
    assert client.post("/v1/completions", json=prompt).json()["choices"][0]["text"] == "Six. END "
