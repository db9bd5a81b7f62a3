"""The `dockrl` command line.

dockrl train CONFIG.yaml [key=value ...]   GRPO through Ray and the transfer dock
dockrl sft CONFIG.yaml [key=value ...]     supervised warm start
dockrl eval --model DIR --data FILE        greedy accuracy on a held-out file
dockrl make-tiny OUT_DIR [--reward-model]  tiny random model (or reward model) + locally trained tokenizer
dockrl data arithmetic OUT_DIR             synthetic task files
dockrl demo                                make-tiny -> SFT -> eval -> GRPO -> eval
dockrl config-docs                         every setting, its type, default and meaning
dockrl columns                             the dock's columns: dtype, producer, readers
dockrl plan --model NAME --dp N ...        per-rank memory of each phase for a model and layouts (and cp)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable


def _cmd_train(args: argparse.Namespace) -> int:
    from dockrl.config import TrainConfig, load_config
    from dockrl.observe import startup
    from dockrl.recipes.grpo import train
    from dockrl.recipes.preflight import preflight_train

    startup.mark("cli")
    resolved = preflight_train(load_config(TrainConfig, args.config, args.overrides))
    summary = train(resolved)
    print(json.dumps({k: v for k, v in summary.items() if k != "final_metrics"}, indent=2))
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from dockrl.config import SFTConfig, load_config
    from dockrl.recipes.preflight import preflight_sft
    from dockrl.recipes.sft import sft

    cfg = preflight_sft(load_config(SFTConfig, args.config, args.overrides))
    print(json.dumps(sft(cfg), indent=2))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from dockrl.checkpoint.directory import resolve_lora
    from dockrl.recipes.eval import evaluate_agent, evaluate_model_dir
    from dockrl.recipes.preflight import check_dataset, check_model_dir, resolve_device

    check_model_dir(resolve_lora(args.model)[0], "--model")  # a checkpoint root: its hf/, or its LoRA base
    check_dataset(args.data, args.prompt_field, args.label_field, "--data")
    if args.agent is not None:
        from dockrl.errors import ConfigError
        from dockrl.serve.agents import load_agent

        try:
            load_agent(args.agent)
        except ValueError as exc:
            raise ConfigError(f"--agent={args.agent!r}: {exc}") from exc
        result = evaluate_agent(
            args.model,
            args.data,
            args.agent,
            _reward_specs(args.reward),
            prompt_field=args.prompt_field,
            label_field=args.label_field,
            max_new_tokens=args.max_new_tokens,
            limit=args.limit,
            device=resolve_device(args.device, "--device"),
        )
        return _print_eval(result, args.records)
    result = evaluate_model_dir(
        args.model,
        args.data,
        _reward_specs(args.reward),
        prompt_field=args.prompt_field,
        label_field=args.label_field,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        device=resolve_device(args.device, "--device"),
        system_prompt=args.system_prompt,
    )
    return _print_eval(result, args.records)


def _print_eval(result: dict, records: str | None) -> int:
    if records:
        with open(records, "w") as f:
            for rec in result["records"]:
                f.write(json.dumps(rec) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from dockrl.checkpoint.directory import resolve_lora
    from dockrl.recipes.preflight import check_model_dir, resolve_device
    from dockrl.serve.model_server import ServeSettings, serve

    check_model_dir(resolve_lora(args.model)[0], "MODEL")
    serve(
        ServeSettings(
            model=args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key or os.environ.get("DOCKRL_API_KEY"),
            max_tokens=args.max_tokens,
            max_batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len,
            device=resolve_device(args.device, "--device"),
            name=args.name,
        )
    )
    return 0


def _reward_specs(names: list[str]) -> list:
    """RewardSpecs of --reward names; a file-given function (`./my_reward.py:fn`) is read here."""
    from pathlib import Path

    from dockrl.config.loader import locate_reward_file
    from dockrl.errors import ConfigError
    from dockrl.rewards.runner import RewardSpec

    specs = []
    for name in names:
        try:
            found = locate_reward_file(name, [Path.cwd()])
        except ValueError as exc:
            raise ConfigError(f"--reward {name}: {exc}") from exc
        code = found.read_text(encoding="utf-8") if found is not None else None
        specs.append(RewardSpec(name=name, code=code, origin=str(found) if found else None))
    return specs


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from dockrl.models.tiny import make_tiny

    path = make_tiny(
        args.out,
        family=args.family,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        seed=args.seed,
        reward_model=args.reward_model,
        tools=args.tools,
        num_experts=args.num_experts,
        num_experts_per_tok=args.experts_per_token,
    )
    print(path)
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    if args.task in ("gsm8k", "math"):
        from dockrl.data.convert import DEFAULT_SYSTEM_PROMPT, convert

        system = DEFAULT_SYSTEM_PROMPT if args.system_prompt is None else args.system_prompt
        print(json.dumps(convert(args.task, args.src, args.out, system_prompt=system), indent=2))
        return 0
    if args.task == "vision":
        from dockrl.data.synthetic_vision import write_vision_task

        paths = write_vision_task(
            args.out,
            num_train=args.num_train,
            num_test=args.num_test,
            seed=args.seed,
            size=args.size,
            kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
            teacher_error=args.teacher_error,
            teacher_samples=args.teacher_samples,
            teacher_hedge=args.teacher_hedge,
        )
        print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
        return 0
    from dockrl.data.synthetic import write_task

    paths = write_task(
        args.task,
        args.out,
        num_train=args.num_train,
        num_test=args.num_test,
        seed=args.seed,
        max_operand=args.max_operand,
        teacher_error=args.teacher_error,
        teacher_samples=args.teacher_samples,
    )
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dockrl.checkpoint.export import export_checkpoint

    written = export_checkpoint(
        args.checkpoint, args.out, dtype=args.dtype, max_shard_gb=args.max_shard_gb, merge=args.merge
    )
    print(json.dumps(written, indent=2))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from dockrl.observe.report import write_report

    print(json.dumps(write_report(args.runs, args.out), indent=2))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from dockrl.recipes.demo import run_demo

    summary = run_demo(args.out, overrides=args.overrides, seed=args.seed, task=args.task, family=args.family)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from dockrl.bench import BENCHMARKS

    result = importlib.import_module(BENCHMARKS[args.bench]).run(args)
    if args.json:
        print(json.dumps(result))
    else:
        rows = result if isinstance(result, list) else [result]
        keys = list(dict.fromkeys(k for row in rows for k in row))  # rows may differ: a blank where absent
        print("  ".join(f"{k:>14}" for k in keys))
        for row in rows:
            print(
                "  ".join(
                    f"{row[k]:>14.4g}" if isinstance(row.get(k), float) else f"{row.get(k, '')!s:>14}"
                    for k in keys
                )
            )
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from dockrl.parallel.memory_plan import GIB, PlanInput, load_args, parse_bytes, plan, render, smallest_cp

    offload = set(args.offload.split(",")) if args.offload else set()
    device_gib = args.device_gib
    if args.device_memory is not None:
        device_gib = parse_bytes(args.device_memory) / GIB
    question = PlanInput(
        load_args(args.model),
        dp=args.dp,
        tp_train=args.tp_train,
        tp_infer=args.tp_infer,
        cp=args.cp,
        activation_bytes=4 if args.precision == "fp32" else 2,
        activation_checkpointing=args.activation_checkpointing,
        offload_optimizer="optimizer" in offload,
        offload_grads="grads" in offload,
        offload_params="params" in offload,
        micro_batch_size=args.micro_batch_size,
        train_seq_len=args.seq_len,
        rollout_batch=args.rollout_batch,
        rollout_seq_len=args.seq_len,
        bucket_bytes=None if args.bucket_mb is None else int(args.bucket_mb * 2**20),
    )
    result = plan(question)
    if device_gib is not None:  # the least cp at which the train phase fits (0: none up to 64)
        result["smallest_cp"] = float(smallest_cp(question, device_gib * GIB) or 0)
    print(json.dumps(result) if args.json else render(result, device_gib))
    return 0


def _cmd_columns(args: argparse.Namespace) -> int:
    from dockrl.dock.columns import render_table

    print("# The experience table\n")
    print("Every column of the transfer dock, declared once in `src/dockrl/dock/columns.py` (this page is")
    print(
        "rendered from it by `dockrl columns`). The dock's clients reject any other column name, a get by a"
    )
    print("stage not among a column's readers and a put by a stage other than its producer (the checkpoint")
    print("stage reads every column and writes it back on resume; stages: `src/dockrl/dock/stages.py`).\n")
    print(render_table())
    return 0


def _cmd_config_docs(args: argparse.Namespace) -> int:
    from dockrl.config import SFTConfig, TrainConfig, render_docs

    for title, cls in (("dockrl train (GRPO)", TrainConfig), ("dockrl sft", SFTConfig)):
        print(f"## {title}\n\n| setting | type | default | meaning |\n|---|---|---|---|")
        print("\n".join(render_docs(cls)) + "\n")
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of every subcommand. With `argv`, only the benchmark it names (if any) imports its
    module for its options: `dockrl train` must not pay for importing fourteen benchmark modules (one of
    them imports torch), seconds of every run's start."""
    parser = argparse.ArgumentParser(
        prog="dockrl", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks of user errors (also DOCKRL_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        return p

    for name, fn, help in (
        ("train", _cmd_train, "GRPO training"),
        ("sft", _cmd_sft, "supervised fine-tuning"),
    ):
        p = add(name, fn, help)
        p.add_argument("config", help="YAML config")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=10 actor.lr=1e-5")

    p = add("serve", _cmd_serve, "an OpenAI-compatible API over a model or checkpoint (docs/serve.md)")
    p.add_argument("model", help="Hugging Face model directory or checkpoint root (step_NNNNNN)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", default=None, help="the bearer key clients send (default: DOCKRL_API_KEY, or a new one)"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="cap of a request's max_tokens")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="prompt + completion tokens per request (default: the model's positions, at most 4096); the KV "
        "cache holds max-batch-size x this, allocated at start",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--name", default=None, help="the model name /v1/models lists (default: the directory's)")

    p = add("eval", _cmd_eval, "greedy accuracy of a checkpoint on a held-out file")
    p.add_argument(
        "--model", required=True, help="Hugging Face model directory or checkpoint root (step_NNNNNN)"
    )
    p.add_argument("--data", required=True, help=".jsonl or .parquet file")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--label-field", default="answer")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--reward", action="append", default=None, help="reward function(s); default exact_answer")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--agent",
        default=None,
        help="an agent function ./agent.py:solve (async def solve(client, row)) run against the model over the "
        "OpenAI API instead of greedy answers (docs/serve.md)",
    )
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--records", default=None, help="write per-prompt answers to this .jsonl")

    from dockrl.models.families import FAMILIES  # torch-free: the records of models/families/

    p = add("make-tiny", _cmd_make_tiny, "tiny random model + locally trained tokenizer (a HF directory)")
    p.add_argument("out")
    p.add_argument("--family", default="qwen2", choices=list(FAMILIES))
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-experts", type=int, default=8, help="qwen3_moe: experts per layer (default 8)")
    p.add_argument(
        "--experts-per-token", type=int, default=2, help="qwen3_moe: the router's top-k (default 2)"
    )
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reward-model",
        action="store_true",
        help="write a *ForSequenceClassification reward model (scalar score head) instead of a causal LM",
    )
    p.add_argument(
        "--tools",
        action="store_true",
        help="train the tokenizer on tool calls and add Qwen2.5's <tool_call> markers as tokens",
    )

    data = add("data", _cmd_data, "write a synthetic task, or convert a published dataset to prompt files")
    tasks = data.add_subparsers(dest="task", required=True)
    for layout, source in (
        ("gsm8k", "question / answer with '#### N'"),
        ("math", "problem / solution or answer"),
    ):
        p = tasks.add_parser(layout, help=f"convert a local {layout} file ({source}) to a dockrl prompt file")
        p.add_argument("src", help="the published layout as .jsonl, .json or .parquet")
        p.add_argument("out", help="output .jsonl (or a directory: OUT/<src name>.jsonl)")
        p.add_argument(
            "--system-prompt",
            default=None,
            help="system message of every prompt (default: asks for the answer in \\boxed{}; '' writes the "
            "question as plain text)",
        )
    p = tasks.add_parser("arithmetic", help="write synthetic task files (train.jsonl, test.jsonl)")
    p.add_argument("out")
    p.add_argument("--num-train", type=int, default=4000)
    p.add_argument("--num-test", type=int, default=200)
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument(
        "--teacher-error",
        type=float,
        default=None,
        help="also write sft.jsonl from a hedging teacher (e.g. 0.7)",
    )
    p.add_argument("--teacher-samples", type=int, default=4, help="teacher answers per training prompt")
    p.add_argument("--seed", type=int, default=0)
    p = tasks.add_parser(
        "vision",
        help="write the synthetic vision task (count dots, name a colour, compare bars): train.jsonl, "
        "test.jsonl and their PNG images (docs/vision.md)",
    )
    p.add_argument("out")
    p.add_argument("--num-train", type=int, default=3000)
    p.add_argument("--num-test", type=int, default=150)
    p.add_argument("--size", type=int, default=56, help="image side in pixels")
    p.add_argument(
        "--kinds", default="count,colour,bars", help="comma-separated subset of count, colour, bars"
    )
    p.add_argument(
        "--teacher-error",
        type=float,
        default=None,
        help="also write sft.jsonl from a noisy teacher that gives a wrong answer this often (e.g. 0.3)",
    )
    p.add_argument("--teacher-samples", type=int, default=2, help="teacher answers per training image")
    p.add_argument(
        "--teacher-hedge",
        action="store_true",
        help="the teacher's errors are second guesses after the right answer ('red or blue'), not other answers",
    )
    p.add_argument("--seed", type=int, default=0)

    p = add("demo", _cmd_demo, "make-tiny -> SFT warm start -> eval -> GRPO -> eval, prints both accuracies")
    p.add_argument("--out", default="runs/demo")
    p.add_argument(
        "--task",
        choices=["arithmetic", "tools", "agent", "vision"],
        default="arithmetic",
        help="arithmetic (single-turn), tools: three-digit multiplication with a calculator (multi-turn), "
        "agent: the same with an agent function calling the calculator over the OpenAI API (docs/agents.md), "
        "or vision: questions about synthetic images on a tiny Qwen2.5-VL (docs/vision.md)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the model's initialisation, the SFT order and the GRPO run"
    )
    p.add_argument(
        "--family",
        choices=["qwen2", "qwen3_moe"],
        default="qwen2",
        help="the tiny model: qwen2 (dense) or qwen3_moe (8 experts, 2 per token)",
    )
    p.add_argument("overrides", nargs="*", help="GRPO overrides, e.g. run.steps=5")

    p = add("report", _cmd_report, "plots (PNG) and report.html of one run, or of several side by side")
    p.add_argument("runs", nargs="+", help="run directories (RUN_DIR with metrics.jsonl)")
    p.add_argument(
        "--out", default=None, help="where to write (default: the run directory; several runs need it)"
    )

    p = add("export", _cmd_export, "a Hugging Face model (or PEFT adapter) directory from a checkpoint")
    p.add_argument(
        "checkpoint",
        help="checkpoint root RUN_DIR/checkpoints/step_NNNNNN, a model directory, or a PEFT adapter directory",
    )
    p.add_argument(
        "out", help="the directory to write (a model; a LoRA checkpoint without --merge: a PEFT adapter)"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="LoRA: fold the adapters into the base and write the merged model",
    )
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: the checkpoint's")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors file")

    add("config-docs", _cmd_config_docs, "print every setting as a Markdown table")
    add("columns", _cmd_columns, "print the dock's experience-table columns as a Markdown table")

    p = add("plan", _cmd_plan, "per-rank memory of train / switch / rollout for a model and layouts")
    p.add_argument(
        "--model", required=True, help="preset (Qwen2.5-7B, Qwen2.5-32B, Qwen3-8B; any case) or config.json"
    )
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree of training (actor.cp)")
    p.add_argument("--tp-train", type=int, default=1)
    p.add_argument("--tp-infer", type=int, default=1)
    p.add_argument("--offload", default="optimizer,grads,params", help="comma list; '' offloads nothing")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", "--tokens", type=int, default=4096, help="prompt + response tokens")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="training compute dtype")
    p.add_argument("--activation-checkpointing", action="store_true", help="actor.activation_checkpointing")
    p.add_argument("--rollout-batch", type=int, default=64, help="sequences one rollout rank decodes at once")
    p.add_argument("--device-gib", type=float, default=None, help="device memory to check against, GiB")
    p.add_argument(
        "--device-memory",
        default=None,
        help="device memory with its unit: 80GB (10^9 bytes), 80GiB (2^30); also names the smallest cp that fits",
    )
    p.add_argument(
        "--bucket-mb", type=float, default=None, help="reshard.bucket_mb (default: largest tensor)"
    )
    p.add_argument("--json", action="store_true")

    import importlib

    from dockrl.bench import BENCHMARKS

    bench = add("bench", _cmd_bench, "benchmarks that print figures").add_subparsers(
        dest="bench", required=True
    )
    words = [a for a in argv if not a.startswith("-")] if argv is not None else None
    for name, module in BENCHMARKS.items():
        p = bench.add_parser(name, help=f"dockrl bench {name}")
        p.add_argument("--json", action="store_true", help="print one JSON document")
        if words is None or words[:2] == ["bench", name]:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dockrl` console script."""
    from dockrl.data.datasets import DatasetError
    from dockrl.errors import ConfigError
    from dockrl.recipes.common import RunFailed

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "reward", "unset") is None:
        args.reward = ["exact_answer"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    debug = args.debug or os.environ.get("DOCKRL_DEBUG", "") not in ("", "0")
    try:
        return args.fn(args)
    except (ConfigError, DatasetError, FileNotFoundError, ValueError) as exc:
        # A user error (a setting, a file, a dataset, user code that fails to import): one line, exit 2;
        # --debug (or DOCKRL_DEBUG=1) shows the traceback.
        if debug:
            raise
        print(f"dockrl {args.command}: error: {exc}", file=sys.stderr)
        print("(dockrl --debug ... shows the traceback)", file=sys.stderr)
        return 2
    except RunFailed as exc:  # a worker or dock failure: named, with how to resume; no Ray traceback
        print(f"dockrl {args.command}: error: {exc}", file=sys.stderr)
        return 1


def console_main() -> None:
    """The `dockrl` console script: `main`, then a fast exit once a command that started its own local Ray
    has written everything it keeps.

    Ray's shutdown stops its daemons one by one with a second of grace each, and the interpreter's teardown
    takes another second (2.3 s of a tiny run's 14). Such a Ray runs under the reaper (workers/reaper.py),
    which SIGKILLs every process of the run the moment this process is gone, so the command flushes its output
    and leaves without them. Runs on a cluster (run.ray_address) exit the ordinary way.
    """
    code = main()
    from dockrl.recipes.common import owns_reaped_ray

    if owns_reaped_ray():
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
