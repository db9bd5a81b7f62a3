"""The agent demo's agent (`dockrl demo --task agent`, configs/demo_agent_grpo.yaml; docs/agents.md): the tool demo's
calculator, called through the OpenAI tools API by an agent function instead of dockrl's built-in environment.

It asks, runs each calculator call the model makes (`message.tool_calls`, parsed by the server in the model's
format) and sends the results back as tool messages, until the model answers without a call; the reward
functions then score that final message (it returns None). Written against the plain `openai` client: the same
function runs on `dockrl serve` or any OpenAI-compatible server.
"""

import json

from dockrl.envs.tools import Calculator, ToolError

CALCULATOR = Calculator()
TOOLS = [Calculator.schema]
MAX_TURNS = 3  # as env.max_turns: a fourth request would end the trajectory truncated


async def solve(client, row):
    messages = [{"role": "user", "content": str(row["prompt"])}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            return None  # the final answer: exact_answer scores it
        messages.append(message)
        for call in message.tool_calls:
            try:
                result = CALCULATOR.run(json.loads(call.function.arguments))
            except (ToolError, ValueError) as exc:
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
