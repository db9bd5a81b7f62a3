"""The TRL arm of `dockrl bench multiturn`: TRL's own multi-turn tool loop (GRPOTrainer(tools=[...])) on the same
trajectories, in a child process, timed around its generation phase.

```
 child process, TRL at its best (bench/e2e.trl_config): one torch thread per core this process may use, sdpa,
 the precision given (dockrl's rule or fp32), the whole step (prompts x samples) as one generation batch
   GRPOTrainer.train(), `rounds` steps, each when the parent asks (its rounds interleave with dockrl's);
   per step, reported to the parent when the whole step has ended:
     _generate_and_score_completions
       _generate                      <- timed: `wall_s`, `cpu_s` (every policy turn and the tool loop)
         generate (transformers)      turn 1, prompts x samples rows, left-padded
         _tool_call_loop              up to max_tool_calling_iterations = turns - 1 times:
                                        call the tool, append the tool message's chat-template suffix,
                                        generate again over prompt + completion + suffix (a full re-prefill)
       rewards, advantages            <- `score_s` = the call less _generate (beta 0: no reference forward)
     the loss, backward, optimizer    (not timed)
```

Forcing the turns. A random model never writes a parsable tool call, so TRL would stop after one turn; dockrl's
arms force theirs with `CalculatorTurns` (bench/rollout_turns.py). Here the child wraps the `parse_response`
that trl.trainer.grpo_trainer calls on every generated message: the message TRL's own parser returns (its
content; a malformed call the model happened to write parses as plain text) gets one `tool_calls` entry,
a call of `calculator` with the row's expression (read back from the prompt's text, "What is A * B?"). With
max_tool_calling_iterations = turns - 1 TRL's loop then runs its real machinery - the tool call, the tool
message, the chat template's suffix, the re-generation - and every trajectory has exactly `turns` policy
turns. The tool is the real calculator (envs/tools.Calculator) as a plain function with the type hints and
docstring TRL reads its schema from, with Calculator.schema's description, so TRL's prompts render exactly as
dockrl's.

Chat template. The tool tokenizer's template writes tool calls in the assistant's text and has no
`tool_calls` field, which trl.chat_template_utils.supports_tool_calling rejects; TRL gets
models/tiny.TOOL_CALLS_CHAT_TEMPLATE (the same template, rendering a `tool_calls` field as Qwen2.5 does;
identical otherwise) and TRL's Qwen response template (trl.chat_template_utils.qwen3_template, what TRL sets
for Qwen2.5's template) for parse_response. TRL keeps it (prefix-preserving: no training template swap).

Budgets: TRL's max_completion_length is the response budget (prompt excluded, tool tokens included: dockrl's
`budget`), generation_kwargs max_new_tokens the per-turn cap (--new-tokens).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# the user's question of rollout_turns' rows, from which the forced call takes its expression
QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")


MARK = "dockrl-trl-turns "  # the child's lines for the parent start with it (Trainer prints its logs)


def trl_installed() -> bool:
    """Whether TRL's arm can run here."""
    import importlib.util

    return importlib.util.find_spec("trl") is not None


class TrlArm:
    """TRL's GRPOTrainer at one precision in a child process, one step (a round: the whole step's trajectories,
    every turn) when `run_round` asks, so that its rounds interleave with dockrl's on a shared host.

    Lifecycle: the constructor starts the child and returns once its trainer is built and waiting (its import
    and model load not timed); `run_round` `rounds` times; `close` waits for the child's end and returns
    {"precision", "config", "rounds": [each round's figures], "trajectories": [the last round's]}."""

    def __init__(
        self, args: argparse.Namespace, model: Path, rows: list[dict[str, Any]], budget: int, precision: str
    ):
        import tempfile

        from dockrl.bench.e2e import available_memory_bytes, trl_config

        shape = argparse.Namespace(
            trl_config="best",
            prompts=args.prompts,
            samples=args.samples,
            max_new_tokens=budget,
            kl_coef=0.0,  # beta 0: no reference model
            trl_threads=args.trl_threads,
        )
        # read before the child starts (and before dockrl's passes: the bench builds its arms first)
        self.config = trl_config(shape, model, available_memory_bytes()) | {"precision": precision}
        spec = {
            "config": self.config,
            "model": str(model),
            "prompts": [row["prompt"] for row in rows[:: args.samples]],
            "samples": args.samples,
            "turns": args.turns,
            "new_tokens": args.new_tokens,
            "budget": budget,
            "rounds": args.rounds,
            "seed": args.seed,
        }
        self.config |= {
            "max_completion_length": budget,
            "max_new_tokens_per_turn": args.new_tokens,
            "max_tool_calling_iterations": args.turns - 1,
            "generation_batch": args.prompts * args.samples,
        }
        self.precision = precision
        self.rounds: list[dict[str, Any]] = []
        self.trajectories: list[dict[str, Any]] = []
        code = f"from dockrl.bench.trl_turns import trl_child; trl_child({json.dumps(spec)!r})"
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self._read()  # ready

    def _read(self) -> Any:
        """The child's next line of its own: its JSON payload."""
        assert self.child.stdout is not None
        for line in self.child.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        self.child.wait()
        self.stderr.seek(0)
        raise RuntimeError(f"TRL run failed (exit {self.child.returncode}):\n{self.stderr.read()[-3000:]}")

    def run_round(self) -> dict[str, Any]:
        """One training step of the child; its generation phase's figures."""
        assert self.child.stdin is not None
        self.child.stdin.write("step\n")
        self.child.stdin.flush()
        out = self._read()
        self.trajectories = out.pop("trajectories")
        self.rounds.append(out)
        return out

    def close(self) -> dict[str, Any]:
        """Wait for the child's end; its rounds."""
        assert self.child.stdin is not None
        self.child.stdin.close()
        if self.child.wait() != 0:
            self.stderr.seek(0)
            raise RuntimeError(
                f"TRL run failed (exit {self.child.returncode}):\n{self.stderr.read()[-3000:]}"
            )
        self.stderr.close()
        return {
            "precision": self.precision,
            "config": self.config,
            "rounds": self.rounds,
            "trajectories": self.trajectories,
        }


def trl_arm(
    args: argparse.Namespace, model: Path, rows: list[dict[str, Any]], budget: int, precision: str
) -> dict[str, Any]:
    """TRL's --rounds rounds of the trajectories `rows` (prompts x samples, grouped by prompt) at `precision`,
    back to back: TrlArm.close's figures."""
    arm = TrlArm(args, model, rows, budget, precision)
    for _ in range(args.rounds):
        arm.run_round()
    return arm.close()


def calculator_tool() -> Any:
    """The real calculator as the plain function TRL's tools are: typed, its schema read from the docstring."""
    from dockrl.envs.tools import Calculator

    calc = Calculator()

    def calculator(expression: str) -> str:
        return calc.run({"expression": expression})

    description = Calculator.schema["function"]["description"]
    argument = Calculator.schema["function"]["parameters"]["properties"]["expression"]
    calculator.__doc__ = (
        f"{description}\n\nArgs:\n    expression: {argument.get('description', 'the expression')}\n"
    )
    return calculator


def force_calls(parse_response: Any, decode: Any) -> Any:
    """`parse_response` whose every message calls `calculator` with the expression of the prompt it follows."""

    def forced(tokenizer: Any, ids: Any, prefix: Any = None, tools: Any = None, **kwargs: Any) -> dict:
        try:
            message = parse_response(tokenizer, ids, prefix=prefix, tools=tools, **kwargs)
        except Exception:  # a malformed call the model wrote: its text, as a message without a call
            message = {"role": "assistant", "content": decode(ids)}
        question = QUESTION.search(decode(prefix))
        if question is None:
            raise RuntimeError("the forced tool call found no 'What is A * B?' in the prompt")
        call = {"expression": f"{question.group(1)}*{question.group(2)}"}
        return message | {
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": call}}]
        }

    return forced


def trl_child(spec_json: str) -> None:
    """In a child process: GRPOTrainer with the calculator tool for `rounds` steps, turns forced, each step when
    the parent writes a line; after each step's generation phase one line (MARK + JSON): its wall and CPU
    seconds, score_s, token counts, and its trajectories (policy turns, tool results, sampled tokens, text)."""
    import tempfile
    import time

    import datasets
    import torch
    import transformers
    import trl.trainer.grpo_trainer as grpo_module
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from dockrl.bench.e2e import grpo_kwargs
    from dockrl.models.tiny import TOOL_CALLS_CHAT_TEMPLATE

    spec = json.loads(spec_json)
    trl = spec["config"]
    torch.set_num_threads(trl["threads"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.chat_template = TOOL_CALLS_CHAT_TEMPLATE
    tokenizer.response_template = qwen3_template
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}]} for p in spec["prompts"]]
    )

    def reward(completions: list, **_: Any) -> list[float | None]:
        return [0.0] * len(completions)  # generation is what is timed; GRPO needs a reward source

    out_dir = tempfile.TemporaryDirectory(prefix="dockrl-bench-multiturn-trl-")
    config = GRPOConfig(
        output_dir=out_dir.name,
        max_steps=spec["rounds"],
        num_generations=spec["samples"],
        max_completion_length=spec["budget"],
        generation_kwargs={"max_new_tokens": spec["new_tokens"]},
        max_tool_calling_iterations=spec["turns"] - 1,
        seed=spec["seed"],
        **grpo_kwargs(trl),
    )

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    grpo_module.parse_response = force_calls(grpo_module.parse_response, decode)
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator_tool()],
    )
    figures: dict[str, Any] = {}  # this round's
    counts = {"generated": 0, "prefilled": 0}  # this round's generate calls: tokens returned, prompts fed
    inner_turn = trainer._generate_single_turn

    def counted_turn(prompt_ids: list, *a: Any, **k: Any) -> Any:
        ids, logprobs = inner_turn(prompt_ids, *a, **k)
        counts["generated"] += sum(map(len, ids))
        counts["prefilled"] += sum(map(len, prompt_ids))
        return ids, logprobs

    trainer._generate_single_turn = counted_turn  # type: ignore[method-assign]
    inner_generate = trainer._generate

    def timed_generate(prompts: list) -> Any:
        counts["generated"] = counts["prefilled"] = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        out = inner_generate(prompts)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        prompt_ids, completion_ids, tool_mask, completions = out[:4]
        figures.update(
            {
                "wall_s": wall,
                "cpu_s": cpu,
                "sampled_tokens": sum(map(sum, tool_mask)),
                "generated_tokens": counts["generated"],
                "prefill_tokens": counts["prefilled"],
                "policy_turns": sum(m["role"] == "assistant" for c in completions for m in c),
                "prompt_tokens": sum(map(len, prompt_ids)),
                "completion_tokens": sum(map(len, completion_ids)),
            }
        )
        figures["trajectories"] = [
            {
                "question": QUESTION.search(decode(p)).group(0),  # type: ignore[union-attr]
                "policy_turns": sum(m["role"] == "assistant" for m in messages),
                "tool_results": [m["content"] for m in messages if m["role"] == "tool"],
                "sampled_tokens": sum(mask),
                "completion_tokens": len(c),
                "text": decode(c),
            }
            for p, c, mask, messages in zip(prompt_ids, completion_ids, tool_mask, completions)
        ]
        return out

    trainer._generate = timed_generate  # type: ignore[method-assign]
    inner_score = trainer._generate_and_score_completions

    def timed_score(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = inner_score(*a, **k)
        figures["score_s"] = time.perf_counter() - start - figures["wall_s"]
        return out

    trainer._generate_and_score_completions = timed_score  # type: ignore[method-assign]

    class Rounds(transformers.TrainerCallback):
        """Ready once built; each step only when the parent asks (a line on stdin; its end stops the run), its
        figures reported when it has ended."""

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            print(MARK + json.dumps({"ready": True}), flush=True)

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if not sys.stdin.readline():
                raise SystemExit("the parent closed stdin before the last step")

        def on_step_end(self, *_: Any, **__: Any) -> None:
            # after the whole step (its loss, backward and optimizer step too): nothing of it may run beside
            # the parent's next timed pass
            print(MARK + json.dumps(figures), flush=True)
            figures.clear()

    trainer.add_callback(Rounds())
    trainer.train()
    out_dir.cleanup()
