"""An agent written with the OpenAI Agents SDK (`pip install 'dockrl[agents]'`), trained by dockrl unchanged.

The SDK's own loop (tool calls, tool results, the final answer) runs over the `client` dockrl hands the agent
function; every request it makes is served by the run's rollout and becomes the sample's trajectory, token in
and token out (docs/agents.md). Train it with

    env: {name: ./agents_sdk_calculator.py:solve, max_turns: 3}

or hold it out with `dockrl eval --model DIR --data test.jsonl --agent ./agents_sdk_calculator.py:solve`.
"""

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from dockrl.envs.tools import Calculator

set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers
CALCULATOR = Calculator()


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. 123*456 or (7+8)/3."""
    return CALCULATOR.run({"expression": expression})


async def solve(client, row):
    agent = Agent(
        name="calculator",
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    try:
        await Runner.run(agent, str(row["prompt"]), max_turns=3)
    except MaxTurnsExceeded:
        pass  # the trajectory ends where the run's limits end it; the last answer is scored
    return None  # the reward functions score the final assistant message
