"""`dockrl bench multiturn`: multi-turn rollout tokens/s against single-turn, at the tool demo's shape, in one run.

```
 one tiny random model (the tool demo's: qwen2, hidden 128 x 4 layers, its tool tokenizer), one engine per pass
 per round, in a rotating order:
   single           the same rows, one policy turn each
   multi_reprefill  `turns` policy turns, a calculator answer after each but the last; every turn prefills
                    its whole prompt (rollout.keep_kv_across_turns=false)
   multi_kept       the same, each later turn prefilling only its new tokens on the KV kept (the default)
 and, with --trl (on when trl is importable), TRL's multi-turn tool loop on the same trajectories, a child
 process per precision (bench/trl_turns.py) whose one training step per round is a mode of the rotation:
   trl_<precision>  GRPOTrainer(tools=[calculator]) at its best (threads = cores, sdpa, the whole step one
                    generation batch), its turns forced as CalculatorTurns forces dockrl's: every message it
                    generates is made a call of the calculator with the row's expression, and
                    max_tool_calling_iterations = turns - 1; every turn re-prefills (TRL's loop)
```

Shape (`--prompts` x `--samples` trajectories, `--new-tokens` per turn, `--turns`): the tool demo's
(configs/demo_tools_grpo.yaml: 16 prompts x 8 samples, 32 tokens per turn, 3 turns, a 160-token response budget,
temperature 1). The environment is `CalculatorTurns`: the user asks a three-digit product (the demo's task), and
each step answers with the real calculator tool's result for it (envs/tools.Calculator), until `turns` policy
turns are done - deterministic, so every trajectory has the same number of turns whatever a random model
samples (the built-in tool environment ends a trajectory at the first message without a parsable call, which
is every message of a random model).

Each row: the mode's best wall seconds of `run_trajectories` over the rounds (engine and host built before the
clock) and the median, sampled (policy) tokens and tokens/s at the best, the process's CPU seconds in that pass
(every thread: on a shared host, CPU time counts the work without the waits for a core) and sampled tokens per
CPU second, positions_per_s (sampled tokens + positions prefilled, per wall second: the positions the model
ran), positions prefilled and positions found kept, and prefill forward calls. `ratio_to_single` is the mode's
sampled tokens/s over single-turn's, `cpu_ratio_to_single` the same per CPU second.
`same_tokens` compares multi_kept's trajectories with multi_reprefill's token by token. dockrl's weights are in
--precision (fp32; auto: dockrl's rule, bf16 on a CPU that computes it natively, where same_tokens is no longer
all: bf16 rounds the kept and re-prefilled forwards differently).

TRL's rows time its generation phase for the whole step (`_generate`: every policy turn and the tool loop; its
rewards and advantages, `score_s`, apart; beta 0, so no reference forward; the loss and backward not timed),
best of --rounds steps as dockrl's, with the same per-turn cap (generation_kwargs max_new_tokens = --new-tokens)
and response budget (max_completion_length). --trl-precision best (the default) runs TRL at dockrl's rule and at
fp32 where they differ (TRL's generate under bf16 autocast is the slower of the two at the demo's width);
`kept_over_trl` is multi_kept's sampled tokens/s over the row's (`cpu_kept_over_trl` per CPU second) and the
`trl_config` row names the faster precision, multi_kept's ratio to it, and TRL's settings. The last rows: the
load average before and after (the host may be shared: compare rows of one run only) and the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from dockrl.bench.env_tier import cpu_row
from dockrl.bench.trl_turns import TrlArm, trl_installed
from dockrl.envs.base import Observation
from dockrl.envs.tools import Calculator

MODES = ("single", "multi_reprefill", "multi_kept")


class CalculatorTurns:
    """A deterministic tool environment: `turns` policy turns, each but the last answered by the calculator's
    result for the row's expression (row["expression"])."""

    tools = [Calculator.schema]

    def __init__(self, turns: int):
        self.turns, self.turn, self.expression = turns, 0, ""
        self.calculator = Calculator()

    def reset(self, row: dict[str, Any]) -> Observation:
        self.expression = str(row["expression"])
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message: str) -> Observation:
        self.turn += 1
        if self.turn >= self.turns:
            return Observation(done=True, reward=1.0)
        answer = self.calculator.run({"expression": self.expression})
        return Observation(messages=[{"role": "tool", "content": answer}], info={"tool_calls": 1})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench multiturn`."""
    parser.add_argument("--prompts", type=int, default=16, help="prompts (the demo's prompts_per_step)")
    parser.add_argument("--samples", type=int, default=8, help="trajectories per prompt")
    parser.add_argument("--turns", type=int, default=3, help="policy turns per multi-turn trajectory")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens sampled per turn (at most)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the rollout engine")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode, interleaved")
    parser.add_argument("--kv-cache", choices=("auto", "slots", "paged"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="fp32",
        help="dockrl's weights (auto: dockrl's rule, bf16 on a CPU that computes it natively; faster, but "
        "then multi_kept and multi_reprefill round differently and same_tokens is no longer all)",
    )
    parser.add_argument(
        "--trl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the TRL arm (TRL's multi-turn tool loop on the same trajectories; bench/trl_turns.py): on by "
        "default when trl is importable",
    )
    parser.add_argument(
        "--trl-precision",
        choices=("best", "auto", "fp32", "bf16"),
        default="best",
        help="TRL's precision; best: both dockrl's rule (--precision auto) and fp32 where they differ, the "
        "faster one TRL's figure (at the demo's width TRL's generate under bf16 autocast runs slower than fp32)",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="torch threads of TRL's process (default: one per core this process may use)",
    )


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per mode, then the load averages and the CPU."""
    import tempfile

    import torch

    from dockrl.models.hf import load_model
    from dockrl.models.tiny import make_tiny
    from dockrl.models.tokenizer import Tokenizer
    from dockrl.recipes.preflight import resolve_precision

    if min(args.turns, args.prompts, args.samples, args.new_tokens, args.rounds) < 1:
        raise SystemExit("--turns, --prompts, --samples, --new-tokens and --rounds must be at least 1")
    torch.set_num_threads(args.threads)
    args.precision = resolve_precision(args.precision, "cpu", key="--precision")
    if args.trl is None:
        args.trl = trl_installed()
    elif args.trl and not trl_installed():
        raise SystemExit("--trl: trl is not installed; pip install -e .[bench], or pass --no-trl")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-multiturn-") as tmp:
        path = make_tiny(
            tmp,
            family="qwen2",
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            seed=args.seed,
            tools=True,
        )
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        tokenizer, model = Tokenizer.from_dir(path), load_model(path, dtype=dtype).eval()
        walls: dict[str, list[float]] = {mode: [] for mode in MODES}
        best: dict[str, dict[str, Any]] = {}
        outputs: dict[str, list] = {}
        # a child process per TRL precision, built (import, model, trainer) before any clock; one step of each
        # is a mode of the rotation, so TRL's rounds and dockrl's share the host's moments alike
        arms = {
            f"trl_{precision}": TrlArm(
                args, Path(path), trajectory_rows(args), response_budget(args), precision
            )
            for precision in (trl_precisions(args) if args.trl else ())
        }
        modes = MODES + tuple(arms)
        for round_index in range(args.rounds):
            order = modes[round_index % len(modes) :] + modes[: round_index % len(modes)]
            for mode in order:
                if mode in arms:
                    arms[mode].run_round()
                    continue
                row, outs = _one_pass(model, tokenizer, mode, args)
                walls[mode].append(row["wall_s"])
                if mode not in best or row["wall_s"] < best[mode]["wall_s"]:
                    best[mode], outputs[mode] = row, outs
        trl = [arm.close() for arm in arms.values()]
    rows = []
    for mode in MODES:
        row = best[mode]
        row["median_wall_s"] = round(statistics.median(walls[mode]), 3)
        for figure in ("tokens_per_s", "tokens_per_cpu_s"):
            ratio = row[figure] / best["single"][figure]
            row["ratio_to_single" if figure == "tokens_per_s" else "cpu_ratio_to_single"] = round(ratio, 3)
        rows.append(row)
    same = sum(
        a["response_ids"].tolist() == b["response_ids"].tolist()
        for a, b in zip(outputs["multi_kept"], outputs["multi_reprefill"])
    )
    rows[-1]["same_tokens"] = f"{same}/{len(outputs['multi_kept'])}"
    if trl:
        rows += trl_rows(trl, best["multi_kept"])
    load_after = os.getloadavg()
    rows.append({"mode": "load", "before": " ".join(f"{x:.2f}" for x in load_before)})
    rows[-1]["after"] = " ".join(f"{x:.2f}" for x in load_after)
    rows.append(cpu_row())
    return rows


def trl_precisions(args: argparse.Namespace) -> list[str]:
    """The precisions TRL runs at: --trl-precision's, or with best dockrl's rule and fp32 (one where equal)."""
    from dockrl.recipes.preflight import resolve_precision

    if args.trl_precision != "best":
        return [resolve_precision(args.trl_precision, "cpu", key="--trl-precision")]
    return sorted({resolve_precision("auto", "cpu"), "fp32"})


def trl_rows(arms: list[dict[str, Any]], kept: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per TRL precision (`trl_<precision>`: its best round, as dockrl's rows; multi_kept's sampled
    tokens/s over its) and the configuration's, naming the faster precision and multi_kept's ratio to it."""
    rows = [_trl_row(arm, kept) for arm in arms]
    fastest = max(zip(rows, arms), key=lambda pair: pair[0]["tokens_per_s"])
    config = fastest[1]["config"]
    setting = {
        "mode": "trl_config",
        "fastest": fastest[0]["mode"],
        "kept_over_trl": fastest[0]["kept_over_trl"],
        "attn": config["attn_implementation"],
        "batch": config["generation_batch"],
        "max_completion": config["max_completion_length"],
        "turn_tokens": config["max_new_tokens_per_turn"],
        "tool_iterations": config["max_tool_calling_iterations"],
        "forcing": "every message calls calculator(row's expression)",
    }
    return rows + [setting]


def _trl_row(trl: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """One TRL run's row: its best round's figures, the median wall, multi_kept's ratios to it."""
    rounds = trl["rounds"]
    row = min(rounds, key=lambda r: r["wall_s"])
    sampled, wall, cpu = row["sampled_tokens"], row["wall_s"], row["cpu_s"]
    return {
        "mode": f"trl_{trl['precision']}",
        "precision": trl["precision"],
        "threads": trl["config"]["threads"],
        "trajectories": len(trl["trajectories"]),
        "turns": row["policy_turns"],
        "wall_s": round(wall, 3),
        "sampled_tokens": sampled,
        "tokens_per_s": round(sampled / wall, 1),
        "cpu_s": round(cpu, 3),
        "tokens_per_cpu_s": round(sampled / cpu, 1),
        "positions_per_s": round((sampled + row["prefill_tokens"]) / wall, 1),
        "prefill_tokens": row["prefill_tokens"],
        "median_wall_s": round(statistics.median(r["wall_s"] for r in rounds), 3),
        "score_s": round(row["score_s"], 3),
        "kept_over_trl": round(kept["tokens_per_s"] / (sampled / wall), 3),
        "cpu_kept_over_trl": round(kept["tokens_per_cpu_s"] / (sampled / cpu), 3),
    }


def response_budget(args: argparse.Namespace) -> int:
    """Tokens a trajectory's response may hold, tool answers included: the demo's 160 at 3 x 32."""
    return args.turns * args.new_tokens + (args.turns - 1) * 32


def trajectory_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """prompts x samples rows, each prompt's samples together: a three-digit product to ask the calculator."""
    operands = [(100 + 37 * i % 900, 100 + 53 * i % 900) for i in range(args.prompts)]
    return [
        {"prompt": f"What is {a} * {b}? Use the calculator.", "expression": f"{a}*{b}", "label": None}
        for a, b in operands
        for _ in range(args.samples)
    ]


def _one_pass(model, tokenizer, mode: str, args: argparse.Namespace) -> tuple[dict[str, Any], list]:
    """Every trajectory once in `mode` on a fresh engine; its row and the trajectories."""
    from dockrl.engines.rollout.multi_turn import ChatDelta, TurnLimits, run_trajectories
    from dockrl.engines.rollout.rollout_engine import RolloutEngine
    from dockrl.engines.rollout.sampling import SamplingParams
    from dockrl.envs.host import EnvHost, LocalEnvs
    from dockrl.models.tokenizer import stop_token_ids

    turns = 1 if mode == "single" else args.turns
    budget = response_budget(args)
    env_rows = trajectory_rows(args)
    tools = CalculatorTurns.tools
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tools=tools
            )
        )
        for row in env_rows
    ]
    stops = stop_token_ids(tokenizer.eos_token_id)
    max_seq_len = max(map(len, prompts)) + budget + 1
    engine = RolloutEngine(
        model,
        num_slots=len(prompts),
        max_seq_len=max_seq_len,
        pad_token_id=0,
        detokenize=tokenizer.decode,
        kv_cache=args.kv_cache,
    )
    host = EnvHost(lambda: CalculatorTurns(turns), concurrency=len(prompts))
    start, cpu_start = time.perf_counter(), time.process_time()
    outs, stats = run_trajectories(
        engine,
        prompts,
        env_rows,
        params=SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=stops),
        groups_per_pull=len(prompts),
        row_seed=lambda row: 1000 + args.seed + row,
        envs=LocalEnvs(host),
        delta=ChatDelta(tokenizer, tools),
        system_prompt=None,
        limits=TurnLimits(turns, turns - 1, budget, 60.0),
        keep_kv=mode != "multi_reprefill",
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    host.close()
    env = stats["env"]
    row = {
        "mode": mode,
        "trajectories": len(prompts),
        "turns": env["turns"],
        "wall_s": round(wall, 3),
        "sampled_tokens": env["policy_tokens"],
        "tokens_per_s": round(env["policy_tokens"] / wall, 1),
        "cpu_s": round(cpu, 3),
        "tokens_per_cpu_s": round(env["policy_tokens"] / cpu, 1),
        "positions_per_s": round((env["policy_tokens"] + env["prefill_tokens"]) / wall, 1),
        "prefill_tokens": env["prefill_tokens"],
        "kv_reused_tokens": env["kv_reused_tokens"],
        "prefill_calls": stats["prefill_calls"],
        "layout": engine.layout,
        "precision": args.precision,
        "threads": args.threads,
    }
    return row, outs
