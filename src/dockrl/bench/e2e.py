"""`dockrl bench e2e`: dockrl against TRL's GRPOTrainer on the same GRPO work, each at its own CPU default.

    model  a make-tiny Qwen2: hidden 256, 8 layers, 8/4 heads, MLP 768, its tokenizer's vocab (~6.4M params);
           --small: the demo's shape (hidden 128, 4 layers, ~0.85M); --moe: a Qwen3-MoE of the same shape
           whose every MLP is 8 experts, 2 per token, each half the dense MLP's width (the active MLP work per
           token is the dense model's; 4x its MLP weights), e.g. with actor.ep=2 among the overrides
    work   the arithmetic task, --prompts prompts (16; 32 small) x --samples samples per step, up to
           --max-new-tokens new tokens (128; 10 small), KL to the reference (--kl-coef), one on-policy
           optimizer step per step

dockrl runs `dockrl train` (actor.dp=--dp, its CPU default precision) in its own local Ray; TRL (when
importable: `pip install -e .[bench]`) runs GRPOTrainer in this process's child, one process, at its fastest
configuration for this machine (--trl-config best, the default): the whole step's prompts x samples completions
in one micro-batch (gradient_accumulation_steps=1) unless its peak memory (bench/trl_memory.py, an upper bound)
exceeds the memory available when the bench started (then the fewest micro-batches that fit, and the output
says so; the row's `peak_rss_gib` is what TRL's process then held at its peak), sdpa attention, and dockrl's
precision rule (bf16 only on a CPU that computes it natively; TRL's own default is bf16, which a CPU without
AVX512-BF16 or AMX emulates ~100x slower than fp32). --trl-config micro gives TRL the configuration this bench
used before (micro-batches of --samples completions, gradient accumulation over the prompts), which is slower.
TRL's one process runs one torch thread per core (--trl-threads: fewer where the machine is shared and
threads that wait on each other at every op cost more than they give). The TRL row's `trl_config` says which
configuration ran. Both do one optimizer step per generation batch.
Reported per system over the steps after the first (median): step seconds, response tokens per second, and
where the time went:
  dockrl  rollout, reference, old log-probs, update (its stage timers) and overhead = step - their sum (the
          reference runs beside the last groups' scoring, which the overhead holds; stages that overlap more
          than that make it smaller)
  trl     generate (generation, rewards and reference log-probs: `_generate_and_score_completions`), train
          (its training_step calls less generate) and overhead = step - training_step calls
`speedup` is dockrl's response tokens/s over TRL's. Ratios, not absolute times, carry to other machines.

The roofline (bench/roofline.py), measured once per run before either system starts: `roofline` holds the
host's fp32 (and, where native, bf16) matmul peak and memory bandwidth at the cores the run may use, with the
load average. `peak_share` per pass: its matmul FLOPs (2 x matmul params per token, x3 for forward and backward,
plus attention's 4 L^2 d per layer and sequence) over its seconds x the peak of its precision (dockrl: rollout,
reference, old log-probs, update; TRL: train, its forward and backward). `decode_bw_share`: dockrl's decode
steps against the bandwidth bound; `decode_roofline_share`: the rollout's attainable seconds (each decode step
bandwidth- or compute-bound, whichever is slower, and the prefill) over its measured seconds (roofline_shares
says how both are counted). `shape_bound`: the share of the peak dockrl's update and reference could reach at
their own matmul shapes, each matmul timed alone on one rank's threads (bench/roofline.py `shape_bound`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dockrl.dock.stages import Stage
from dockrl.observe import metric_names as names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload size and which systems."""
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per system (the first is not timed)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (16; 32 with --small)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="128; 10 with --small")
    parser.add_argument("--kl-coef", type=float, default=0.04)
    parser.add_argument("--dp", type=int, default=2, help="dockrl's actor.dp")
    parser.add_argument(
        "--small",
        action="store_true",
        help="the small workload: the demo's 0.85M model, 32 prompts, 10 tokens",
    )
    parser.add_argument(
        "--moe", action="store_true", help="a Qwen3-MoE of the same shape (8 experts, 2 per token)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="LM-head rows (the tokenizer's ~500 padded up, as real checkpoints pad): 8000 or 32000 give a "
        "real vocabulary-to-hidden ratio (Qwen2.5-0.5B: 151,936 / 896 = 170)",
    )
    parser.add_argument(
        "--eos-rate",
        type=float,
        default=None,
        help="the model ends a response with about this probability per token (geometric, long-tailed "
        "lengths: mean ~1/rate, a few reach --max-new-tokens), e.g. 0.01 with --max-new-tokens 512",
    )
    parser.add_argument("--systems", default="dockrl,trl", help="comma list of dockrl, trl")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="bound on each run")
    add_trl_config_argument(parser)
    parser.add_argument("overrides", nargs="*", help="dockrl train overrides, e.g. run.precision=bf16")


TRL_CONFIGS = ("best", "micro")


def add_trl_config_argument(parser: argparse.ArgumentParser) -> None:
    """--trl-config: TRL at its fastest on this machine (best) or the earlier micro-batched configuration."""
    parser.add_argument(
        "--trl-config",
        choices=TRL_CONFIGS,
        default="best",
        help="best: the whole step in one micro-batch where TRL's memory estimate fits in the memory available "
        "at the start (else the fewest micro-batches that fit), sdpa attention; micro: micro-batches of "
        "--samples completions with gradient accumulation over the prompts (the configuration before issue 47, "
        "slower)",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="torch threads of TRL's one process (default: one per core this process may use); 1 where the "
        "machine is shared and more threads wait on each other (dockrl's ranks run one thread each)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both systems on one workspace; {"workload": ..., "dockrl": row, "trl": row or a reason, "speedup"}."""
    from dockrl.data.synthetic import write_task
    from dockrl.models.tiny import make_tiny

    systems = args.systems.split(",")
    unknown = sorted(set(systems) - {"dockrl", "trl"})
    if unknown:
        raise SystemExit(f"--systems={args.systems}: unknown {unknown}; use a comma list of dockrl, trl")
    args.prompts = args.prompts or (32 if args.small else 16)
    args.max_new_tokens = args.max_new_tokens or (10 if args.small else 128)
    out: dict[str, Any] = {}
    available = available_memory_bytes()  # before either system runs (see available_memory_bytes)
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-e2e-") as tmp:
        root = Path(tmp)
        shape = dict(_SMALL if args.small else _LARGE)
        if args.moe:
            width = shape.get("intermediate_size") or 3 * shape["hidden_size"]
            shape.update(
                family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=width // 2
            )
        # positions for the longest prompt kept (data.max_prompt_len: 64) and the longest response
        positions = max(512, _MAX_PROMPT_LEN + args.max_new_tokens)
        model = make_tiny(
            root / "model",
            seed=0,
            padded_vocab_size=args.vocab_size,
            eos_rate=args.eos_rate,
            max_position_embeddings=positions,
            **shape,
        )
        data = write_task("arithmetic", root / "data", num_train=256, num_test=32, seed=0)
        out["workload"] = {
            "params_m": _num_params(model) / 1e6,
            "active_params_m": _active_params(model) / 1e6,
            "family": "qwen3_moe" if args.moe else "qwen2",
            "vocab_size": _vocab_size(model),
            "eos_rate": args.eos_rate,
            "prompts": args.prompts,
            "samples": args.samples,
            "max_new_tokens": args.max_new_tokens,
            "kl_coef": args.kl_coef,
        }
        out["roofline"] = peak = measure_peak()
        if "dockrl" in systems:
            out["dockrl"] = _dockrl(args, root, model, data["train"], peak)
        if "trl" in systems:
            out["trl"] = _trl(args, root, model, data["train"], available, peak)
    if isinstance(out.get("dockrl"), dict) and isinstance(out.get("trl"), dict) and "step_s" in out["trl"]:
        out["speedup"] = out["dockrl"]["response_tokens_per_s"] / out["trl"]["response_tokens_per_s"]
    return out


def measure_peak() -> dict[str, Any]:
    """The roofline of this run (bench/roofline.py): matmul peaks and bandwidth at the cores this process may
    use (every rank of both systems shares them), and the load average while it was measured."""
    from dockrl.bench.roofline import measure_peak as measure

    peak = measure(len(os.sched_getaffinity(0)))
    peak["loadavg"] = os.getloadavg()
    return peak


_MAX_PROMPT_LEN = 64  # dockrl's data.max_prompt_len (the task's prompts are ~15 tokens)
_LARGE: dict[str, Any] = dict(
    family="qwen2", hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=768
)
_SMALL: dict[str, Any] = dict(
    family="qwen2", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2
)  # the demo's shape


def _num_params(model_dir: Path) -> int:
    from dockrl.models.hf import read_config

    return read_config(model_dir).num_params()


def _vocab_size(model_dir: Path) -> int:
    from dockrl.models.hf import read_config

    return read_config(model_dir).vocab_size


def _active_params(model_dir: Path) -> int:
    """Parameters one token's forward multiplies by: an MoE layer's k routed experts, not all E; the LM head
    once (an untied embedding is a lookup, not a matmul)."""
    from dockrl.models.hf import read_config

    a = read_config(model_dir)
    idle = (a.num_experts - a.num_experts_per_tok) * 3 * a.hidden_size * a.moe_intermediate_size
    lookup = 0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    return a.num_params() - idle * len(a.moe_layers) - lookup


def _dockrl(
    args: argparse.Namespace, root: Path, model: Path, train: Path, peak: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`dockrl train` of the workload; medians over the steps after the first."""
    config = root / "dockrl.yaml"
    config.write_text(
        f"rollout: {{samples_per_prompt: {args.samples}, max_new_tokens: {args.max_new_tokens}}}\n"
        f"actor: {{dp: {args.dp}, lr: 1.0e-5}}\n"  # micro-batches: the token budget, dockrl's default
        f"algo: {{kl_coef: {args.kl_coef}}}\n"
        "reward: {functions: [{name: exact_answer}]}\n"
        f"data: {{max_prompt_len: {_MAX_PROMPT_LEN}}}\n"
        f"run: {{steps: {args.steps}, prompts_per_step: {args.prompts}, progress: false, log_samples: 0}}\n"
    )
    argv = [sys.executable, "-m", "dockrl.cli", "train", str(config), f"model.path={model}"]
    argv += [f"data.train_path={train}", f"run.output_dir={root / 'runs'}", "run.name=dockrl"]
    argv += list(args.overrides)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"dockrl train failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rows = [
        json.loads(line) for line in (root / "runs" / "dockrl" / "metrics.jsonl").read_text().splitlines()
    ]
    timed = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in timed)

    timed_stages = (Stage.ROLLOUT, Stage.REFERENCE, Stage.OLD_LOGPROBS, Stage.UPDATE)
    stages = {name: median(names.timing(name)) for name in timed_stages}
    step = median(names.TIMING_STEP)
    import yaml

    resolved = yaml.safe_load((root / "runs" / "dockrl" / "config.yaml").read_text())
    tokens = median(names.TOKENS_PROMPT) + median(names.TOKENS_RESPONSE)
    precision = resolved["run"]["precision"]
    row = {
        "precision": precision,
        "step_s": step,
        "response_tokens_per_s": statistics.median(
            r[names.TOKENS_RESPONSE] / r[names.TIMING_STEP] for r in timed
        ),
        **{f"{name}_s": seconds for name, seconds in stages.items()},
        "overhead_s": step - sum(stages.values()),
        "response_length_mean": median(names.RESPONSE_LENGTH_MEAN),
        "tokens_per_step": tokens,
    }
    if peak is not None:
        row.update(roofline_shares(args, model, stages, tokens, row["response_length_mean"], precision, peak))
    return row


def roofline_shares(
    args: argparse.Namespace,
    model: Path,
    stages: dict[Stage, float],
    tokens: float,
    response_length: float,
    precision: str,
    peak: dict[str, Any],
) -> dict[str, Any]:
    """dockrl's passes against the roofline (bench/roofline.py): `peak_share` per pass (its matmul FLOPs over its
    seconds x the measured peak of the run's precision), and `decode_bw_share`, the rollout's decode steps
    against the bandwidth bound (each step reads the weights once per rollout rank, --dp of them, and every
    sequence's KV cache; the steps taken as the mean response length, the stage's seconds including its
    prefill and switch: a lower bound of the decode steps' own share), and `decode_roofline_share`, the
    attainable seconds of the rollout (roofline.rollout_seconds: the prefill at the peak, each decode step
    at the slower of its traffic and its FLOPs; every sequence taken at the mean prompt and response lengths,
    rounded) over the stage's seconds; `shape_bound`, the update's and reference's share of the peak that their
    own matmul shapes allow on one rank (roofline.shape_bound: each matmul timed alone at the rank's threads,
    against the peak at that thread count): how far the passes could go if nothing but their matmuls ran."""
    import torch

    from dockrl.bench import roofline
    from dockrl.engines.rollout.kv_layouts import cache_dtype
    from dockrl.models.decoder import native_layers
    from dockrl.models.hf import read_config

    margs = read_config(model)
    sequences = args.prompts * args.samples
    length = tokens / sequences
    lengths = [length] * sequences
    rate = roofline.peak_flops(peak, precision)
    shares = {
        name: roofline.share(roofline.pass_flops(margs, name, lengths), seconds, rate)
        for name, seconds in stages.items()
        if seconds > 0
    }
    out: dict[str, Any] = {"peak_share": shares}
    # what the passes' own matmul shapes allow on one rank (its share of the sequences, its threads)
    ranks = max(1, args.dp)
    threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    bound = roofline.shape_bound(margs, lengths[: max(1, sequences // ranks)], precision, threads=threads)
    if bound is not None:
        out["shape_bound"] = bound
    rollout_s = stages.get(Stage.ROLLOUT, 0.0)
    if rollout_s > 0 and response_length >= 1:
        prompt = length - response_length
        contexts = [prompt + response_length / 2] * sequences
        # the cache's bytes as the rollout ranks keep it (rollout.native_kernels at its default)
        weights = torch.bfloat16 if precision == "bf16" else torch.float32
        kv_bytes = cache_dtype(weights, torch.device("cpu"), native_layers(margs)).itemsize
        step_bytes = roofline.decode_step_bytes(
            margs, contexts, weight_bytes=2 if precision == "bf16" else 4, kv_bytes=kv_bytes, ranks=args.dp
        )
        out["decode_bw_share"] = roofline.share(
            step_bytes, rollout_s / response_length, peak["bandwidth_gbs"] * 1e9
        )
        attainable = roofline.rollout_seconds(
            margs,
            round(prompt),
            [max(1, round(response_length))] * sequences,
            weight_bytes=2 if precision == "bf16" else 4,
            kv_bytes=kv_bytes,
            flops_per_s=rate,
            bytes_per_s=peak["bandwidth_gbs"] * 1e9,
            ranks=args.dp,
        )
        out["decode_roofline_share"] = roofline.share(attainable, rollout_s, 1.0)
    return out


def trl_config(args: argparse.Namespace, model: Path, available_bytes: int) -> dict[str, Any]:
    """TRL's configuration for the workload (--trl-config): best, the whole step of prompts x samples
    completions in one micro-batch (gradient_accumulation_steps=1) without gradient checkpointing (GRPOConfig
    turns it on by default: one more forward per backward; dockrl's actor.activation_checkpointing is off), as
    long as TRL's peak memory for it (bench/trl_memory.py, an upper bound) fits in `available_bytes`, the memory
    available when the bench started; else the fewest micro-batches of whole prompt groups that fit without
    checkpointing (a micro-batch of a few thousand tokens costs little more per token, a recomputed forward a
    third more), then the same with it (`fell_back` saying which and why); sdpa attention. micro: micro-batches of --samples with accumulation over the
    prompts (GRPOConfig's checkpointing). The precision is dockrl's rule (run.precision=auto on this CPU) in
    both, the threads --trl-threads (default: one per core this process may use)."""

    from dockrl.bench.trl_memory import trl_step_bytes
    from dockrl.models.hf import read_config
    from dockrl.recipes.preflight import resolve_precision

    precision = resolve_precision("auto", "cpu")
    threads = getattr(args, "trl_threads", None) or len(os.sched_getaffinity(0))
    config: dict[str, Any] = {
        "name": args.trl_config,
        "precision": precision,
        "attn_implementation": "sdpa",
        "threads": threads,
        "available_gib": available_bytes / 2**30,
    }
    if args.trl_config == "micro":
        return config | {
            "per_device_train_batch_size": args.samples,
            "gradient_accumulation_steps": args.prompts,
            "gradient_checkpointing": True,
        }
    length = _MAX_PROMPT_LEN + args.max_new_tokens
    margs = read_config(model)
    step_rows = args.prompts * args.samples

    def estimate(rows: int, checkpointing: bool) -> float:
        return trl_step_bytes(margs, rows, length, precision, step_rows, args.kl_coef > 0, checkpointing)[
            "total"
        ]

    choices = [
        (accumulation, checkpointing)
        for checkpointing in (False, True)
        for accumulation in range(1, args.prompts + 1)
        if args.prompts % accumulation == 0
    ]
    accumulation, checkpointing = next(
        (choice for choice in choices if estimate(step_rows // choice[0], choice[1]) <= available_bytes),
        choices[-1],
    )
    rows = step_rows // accumulation
    fell_back = (
        None
        if (accumulation, checkpointing) == (1, False)
        else f"one micro-batch of {step_rows} rows without gradient checkpointing needs about "
        f"{estimate(step_rows, False) / 2**30:.1f} GiB, over the {available_bytes / 2**30:.1f} GiB available: "
        f"{accumulation} micro-batch{'es' if accumulation > 1 else ''} of {rows}, gradient checkpointing "
        f"{'on' if checkpointing else 'off'}"
    )
    return config | {
        "per_device_train_batch_size": rows,
        "gradient_accumulation_steps": accumulation,
        "gradient_checkpointing": checkpointing,
        "memory_estimate_gib": estimate(rows, checkpointing) / 2**30,
        "fell_back": fell_back,
    }


def available_memory_bytes() -> int:
    """Memory the kernel reports available now (MemAvailable: free plus what it can reclaim), in bytes. The
    benches read it once, before any system runs: memory a finished run has not yet returned would otherwise
    count against TRL."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError("/proc/meminfo has no MemAvailable line (not Linux?)")


def _trl(
    args: argparse.Namespace,
    root: Path,
    model: Path,
    train: Path,
    available_bytes: int,
    peak: dict[str, Any] | None = None,
) -> dict[str, Any] | str:
    """TRL's GRPOTrainer on the same work, in a child process; a reason string when TRL is missing.
    `available_bytes`: the memory available when the bench started (`available_memory_bytes`)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return "trl is not installed (pip install -e .[bench]); skipped"

    # TRL's GRPOConfig defaults to bf16 even on a CPU, where a CPU without native bf16 (AVX2 only) emulates it
    # at ~1 GFLOP/s; TRL then gets dockrl's rule (run.precision=auto): bf16 only where the CPU computes it.
    config = trl_config(args, model, available_bytes)
    spec = {
        "config": config,
        "model": str(model),
        "train": str(train),
        "out": str(root / "trl"),
        "steps": args.steps,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "kl_coef": args.kl_coef,
    }
    code = f"from dockrl.bench.e2e import trl_child; trl_child({json.dumps(spec)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=args.timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"TRL run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["trl_config"] = config
    if peak is not None and row.get("train_s"):
        from dockrl.bench import roofline
        from dockrl.models.hf import read_config

        # TRL's train: the policy's forward and backward over the step's sequences (its reference and old
        # log-prob forwards are inside generate)
        sequences = args.prompts * args.samples
        lengths = [row["tokens_per_sequence"]] * sequences
        work = roofline.pass_flops(read_config(model), "update", lengths)
        rate = roofline.peak_flops(peak, config["precision"])
        row["peak_share"] = {"train": roofline.share(work, row["train_s"], rate)}
    return row


def grpo_kwargs(trl: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig's arguments for TRL at the configuration `trl_config` chose (its micro-batches, attention,
    checkpointing and precision), on the CPU, at temperature 1, with no logging or saving of its own: what
    every TRL child of the benches shares."""
    return {
        # one optimizer step per prompts x samples completions: per_device x accumulation of them
        "per_device_train_batch_size": trl["per_device_train_batch_size"],
        "gradient_accumulation_steps": trl["gradient_accumulation_steps"],
        "model_init_kwargs": {"attn_implementation": trl["attn_implementation"]},
        "gradient_checkpointing": trl["gradient_checkpointing"],
        "learning_rate": 1e-5,
        "temperature": 1.0,
        "use_cpu": True,
        "bf16": trl["precision"] == "bf16",
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
    }


def trl_child(spec_json: str) -> None:
    """In a child process: run GRPOTrainer on the workload and print one JSON line of its figures."""
    import time

    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from dockrl.rewards.builtin import exact_answer

    spec = json.loads(spec_json)
    import torch

    torch.set_num_threads(spec["config"].get("threads") or torch.get_num_threads())
    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [exact_answer("", text, label).score for text, label in zip(texts, answer)]

    config = GRPOConfig(
        output_dir=spec["out"],
        max_steps=spec["steps"],
        num_generations=spec["samples"],
        max_completion_length=spec["max_new_tokens"],
        beta=spec["kl_coef"],
        **grpo_kwargs(spec["config"]),
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    generate_s: list[float] = []
    sequence_tokens: list[float] = []  # real (unpadded) prompt + completion tokens per sequence, per call
    padded_lengths: list[int] = []  # the padded prompt + completion length the step's forwards run at
    inner = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        start = time.perf_counter()
        try:
            out = inner(*a, **k)
        finally:
            generate_s.append(time.perf_counter() - start)
        masks = out["prompt_mask"], out["completion_mask"]
        sequence_tokens.append(float(sum(m.sum() for m in masks)) / len(masks[0]))
        padded_lengths.append(sum(m.shape[1] for m in masks))
        return out

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign]
    # Trainer.training_step (inputs prepared, generation included, forward, backward) summed per optimizer
    # step: what is left of a step is TRL's overhead (optimizer step, data loading, logging, callbacks).
    inner_step, compute = trainer.training_step, [0.0]
    compute_s: list[float] = []

    def timed_step(*a, **k):
        start = time.perf_counter()
        try:
            return inner_step(*a, **k)
        finally:
            compute[0] += time.perf_counter() - start

    trainer.training_step = timed_step  # type: ignore[method-assign]
    step_ends: list[float] = []
    lengths: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            if not step_ends:
                step_ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())
            compute_s.append(compute[0])
            compute[0] = 0.0

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer.add_callback(Clock())
    start_rss = _rss_bytes("VmRSS")  # the process, the policy and the reference model, before any step
    trainer.train()
    steps = [b - a for a, b in zip(step_ends, step_ends[1:])][1:]  # after the first
    generate = generate_s[1 : 1 + len(steps)] if len(generate_s) > len(steps) else generate_s[-len(steps) :]
    completions = spec["prompts"] * spec["samples"]
    tokens = [n * completions for n in lengths[1 : 1 + len(steps)]]
    step = statistics.median(steps)
    in_steps = statistics.median(compute_s[1 : 1 + len(steps)])  # training_step calls per step, generation in
    print(
        json.dumps(
            {
                "precision": "bf16" if config.bf16 else "fp32",
                "step_s": step,
                "response_tokens_per_s": statistics.median(t / s for t, s in zip(tokens, steps)),
                "generate_s": statistics.median(generate),
                "train_s": in_steps - statistics.median(generate),
                "overhead_s": step - in_steps,
                "response_length_mean": statistics.median(lengths[1:]) if len(lengths) > 1 else None,
                "tokens_per_sequence": statistics.median(sequence_tokens),
                # the child's high-water resident memory: what `trl_config`'s estimate bounds
                "peak_rss_gib": _rss_bytes("VmHWM") / 2**30,
                "start_rss_gib": start_rss / 2**30,
                "padded_length": max(padded_lengths),
            }
        )
    )


def _rss_bytes(field: str) -> int:
    """This process's resident memory now (VmRSS) or at its peak (VmHWM), from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"/proc/self/status has no {field} line (not Linux?)")
