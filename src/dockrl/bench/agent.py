"""`dockrl bench agent`: the same multi-turn workload through an agent function over the OpenAI-compatible
endpoint and through a built-in-style environment, in one process on one engine.

```
 N prompts ─▶ run_trajectories (RolloutEngine, tiny random model, --slots slots), T turns per trajectory:
     environment  LocalEnvs(EnvHost): reset answers the user turn, each step a tool message, the last done
     agent        LocalEnvs(AgentHost): an agent function sends the user turn (with the tool's schema), then
                  the answer it got back and a tool message, T requests, over HTTP with the `openai` client
```

Both render the same conversation with the same tools and sample each turn with the same seed, so their
trajectories are the same tokens (the `same_tokens` column checks it, trajectory by trajectory): what differs is
only how the turns travel. Each row: wall seconds of run_trajectories (engine and host built before the clock),
policy tokens/s, requests (turns) per second; the agent row adds `added_ms_per_request`, its extra wall time
over the environment's divided by its requests (HTTP, JSON, the client, the chat template's render), and its
requests' median round trip as the agent saw it. The last row names the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from dockrl.bench.env_tier import cpu_row
from dockrl.envs.base import Observation

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


class ToolTurns:
    """The environment side of the workload: `turns` policy turns, a tool message after each but the last."""

    tools = [TOOL]

    def __init__(self, turns: int):
        self.turns, self.turn = turns, 0

    def reset(self, row: dict[str, Any]) -> Observation:
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message: str) -> Observation:
        self.turn += 1
        if self.turn >= self.turns:
            return Observation(done=True, reward=1.0)
        return Observation(
            messages=[{"role": "tool", "content": f"result {self.turn}"}], info={"tool_calls": 1}
        )


def agent_of(turns: int, latencies: list[float]) -> Any:
    """The agent side of the same workload; each request's round trip (seconds) goes to `latencies`."""

    async def solve(client: Any, row: dict[str, Any]) -> float:
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        for turn in range(1, turns + 1):
            start = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])
            latencies.append(time.perf_counter() - start)
            if turn < turns:
                messages += [reply.choices[0].message, {"role": "tool", "content": f"result {turn}"}]
        return 1.0

    return solve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench agent`."""
    parser.add_argument("--trajectories", type=int, default=64, help="trajectories (--quick: 8)")
    parser.add_argument("--turns", type=int, default=3, help="policy turns (requests) per trajectory")
    parser.add_argument(
        "--new-tokens", type=int, default=16, help="tokens the policy samples per turn (at most)"
    )
    parser.add_argument("--slots", type=int, default=32, help="the rollout engine's slots")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the rollout engine")
    parser.add_argument(
        "--repeats", type=int, default=1, help="passes of each mode (the best wall time is kept)"
    )
    parser.add_argument("--quick", action="store_true", help="8 trajectories (tests)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The environment's row, the agent's row, the CPU's row."""
    import tempfile

    import openai  # noqa: F401  (imported before the clock: the agent host's clients use it)
    import torch

    from dockrl.engines.rollout.multi_turn import ChatDelta, TurnLimits, run_trajectories
    from dockrl.engines.rollout.rollout_engine import RolloutEngine
    from dockrl.engines.rollout.sampling import SamplingParams
    from dockrl.envs.host import EnvHost, LocalEnvs
    from dockrl.models.hf import load_model
    from dockrl.models.tiny import make_tiny
    from dockrl.models.tokenizer import Tokenizer, stop_token_ids
    from dockrl.serve.agent_host import AgentHost

    if args.turns < 1 or args.trajectories < 1:
        raise SystemExit("--turns and --trajectories must be at least 1")
    count = 8 if args.quick else args.trajectories
    torch.set_num_threads(args.threads)
    budget = args.turns * (args.new_tokens + 64)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-agent-") as tmp:
        path = make_tiny(tmp, family="qwen2", hidden_size=64, num_layers=2, seed=args.seed)
        tokenizer, model = Tokenizer.from_dir(path), load_model(path).eval()
        stops = stop_token_ids(tokenizer.eos_token_id)
        texts = [f"task {i}" for i in range(count)]
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tools=[TOOL]
                )
            )
            for t in texts
        ]
        settings = dict(
            params=SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stops),
            groups_per_pull=count,
            row_seed=lambda row: 1000 + row,
            delta=ChatDelta(tokenizer, [TOOL]),
            system_prompt=None,
            limits=TurnLimits(args.turns + 1, args.turns, budget, 60.0),
        )
        max_seq_len = max(prompts, key=len).__len__() + budget + 1
        outputs: dict[str, list] = {}
        for mode in ("environment", "agent"):
            best: dict[str, Any] | None = None
            for _ in range(max(1, args.repeats)):
                latencies: list[float] = []
                if mode == "environment":
                    host: Any = EnvHost(lambda: ToolTurns(args.turns), concurrency=count)
                else:
                    host = AgentHost(
                        agent_of(args.turns, latencies),
                        tokenizer,
                        "qwen2",
                        stop_token_ids=stops,
                        vocab_size=model.args.vocab_size,
                        max_seq_len=max_seq_len,
                        max_tokens=budget,
                    )
                engine = RolloutEngine(
                    model,
                    num_slots=args.slots,
                    max_seq_len=max_seq_len,
                    pad_token_id=0,
                    detokenize=tokenizer.decode,
                )
                rows_in = [{"prompt": t, "label": None} for t in texts]
                start = time.perf_counter()
                outs, stats = run_trajectories(engine, prompts, rows_in, envs=LocalEnvs(host), **settings)
                wall = time.perf_counter() - start
                host.close()
                env = stats["env"]
                row = {
                    "mode": mode,
                    "trajectories": count,
                    "wall_s": round(wall, 3),
                    "turns": env["turns"],
                    "policy_tokens": env["policy_tokens"],
                    "tokens_per_s": round(env["policy_tokens"] / wall, 1),
                    "requests_per_s": round(env["turns"] / wall, 2),
                    "failed": env["failed"],
                    "prefix_breaks": env["prefix_breaks"],
                }
                if latencies:
                    row["median_round_trip_ms"] = round(1000 * statistics.median(latencies), 2)
                if best is None or wall < best["wall_s"]:
                    best, outputs[mode] = row, outs
            assert best is not None
            rows.append(best)
    env_row, agent_row = rows
    agent_row["added_ms_per_request"] = round(
        1000 * (agent_row["wall_s"] - env_row["wall_s"]) / max(1, agent_row["turns"]), 2
    )
    same = sum(
        a["response_ids"].tolist() == e["response_ids"].tolist()
        for a, e in zip(outputs["agent"], outputs["environment"])
    )
    agent_row["same_tokens"] = f"{same}/{count}"
    rows.append(cpu_row())
    return rows
