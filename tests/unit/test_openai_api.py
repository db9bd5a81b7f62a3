"""The OpenAI API's shapes (serve/openai_api.py): requests checked and rendered, responses built; no server."""

import json

import pytest

from dockrl.serve.openai_api import (
    ApiError,
    ChatRequest,
    Sampled,
    chat_messages,
    chat_response,
    chat_sampling,
)


def test_an_assistant_tool_call_is_written_back_in_the_familys_format():
    request = ChatRequest(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is 2*3?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "6"},
        ]
    )
    qwen = chat_messages(request, "qwen2")
    assert qwen[0] == {"role": "user", "content": "What is 2*3?"}
    # exactly what a Qwen model writes (no newline before the block when there is no content)
    assert qwen[1]["content"] == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    )
    assert json.loads(chat_messages(request, "llama")[1]["content"]) == {
        "name": "calculator",
        "parameters": {"expression": "2*3"},
    }
    request.messages[1]["content"] = "Let me compute."
    assert chat_messages(request, "qwen2")[1]["content"] == "Let me compute.\n" + qwen[1]["content"]


def test_a_sampled_tool_call_becomes_openai_tool_calls():
    text = (
        'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    )
    sampled = Sampled([5, 6, 7], [-0.1, -0.2, -0.3], "stop")
    out = chat_response(
        "m", [1, 2], sampled, text, "qwen2", ["a", "b", "c"], with_logprobs=True, parse_tools=True
    )
    (choice,) = out["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {
        "expression": "2*3"
    }
    assert choice["message"]["content"] == "Let me compute." and choice["finish_reason"] == "tool_calls"
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.1, -0.2, -0.3]
    assert choice["token_ids"] == [5, 6, 7] and out["prompt_token_ids"] == [1, 2]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    plain = chat_response(
        "m", [1], Sampled([5], [-0.1], "length"), "hi", "qwen2", ["hi"], with_logprobs=False
    )
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert plain["choices"][0]["finish_reason"] == "length" and plain["choices"][0]["logprobs"] is None
    # a request without tools gets the model's text as it wrote it; a call that does not parse stays text
    untooled = chat_response("m", [1], sampled, text, "qwen2", ["a", "b", "c"], with_logprobs=False)
    assert untooled["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert untooled["choices"][0]["finish_reason"] == "stop"
    broken = "<tool_call>{not json}</tool_call>"
    kept = chat_response("m", [1], sampled, broken, "qwen2", ["a"], with_logprobs=False, parse_tools=True)
    assert (
        kept["choices"][0]["message"]["content"] == broken and kept["choices"][0]["finish_reason"] == "stop"
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 2}, "n"),
        ({"stream": True}, "stream"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"temperature": 3.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ],
)
def test_what_is_not_served_is_a_400_naming_the_field(fields, param):
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    with pytest.raises(ApiError) as error:
        chat_sampling(request, 64)
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body()["error"]["type"] == "invalid_request_error"


def test_max_tokens_is_capped_and_roles_are_checked():
    assert chat_sampling(ChatRequest(messages=[], max_tokens=500), 64).max_tokens == 64
    assert chat_sampling(ChatRequest(messages=[], max_completion_tokens=8), 64).max_tokens == 8
    with pytest.raises(ApiError, match="role='robot'"):
        chat_messages(ChatRequest(messages=[{"role": "robot", "content": "x"}]), "qwen2")


def test_tools_for_a_family_without_a_tool_call_format_are_a_400():
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    with pytest.raises(ApiError, match="qwen3_moe") as error:
        chat_messages(request, "qwen3_moe")
    assert error.value.status == 400 and error.value.param == "tools"
    assert chat_messages(request, "qwen3") == [{"role": "user", "content": "hi"}]
