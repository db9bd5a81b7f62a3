"""Single-process checks of dockrl on one CUDA device (torch and transformers only: never imports Ray).

Usage (from the repository root):

    PYTHONPATH=src python scripts/gpu_check.py [--device cuda|cpu] [--quick] [--out DIR]

Every part prints one JSON object on one stdout line, {"part": NAME, ...}; a part that raises prints
{"part": NAME, "error": "..."} and the script goes on with the next part. A last line {"part": "summary", ...}
lists the failed parts and says whether Ray was imported ("ray_imported", must be false). The exit status is
nonzero when a part raised or one of its checks ("ok": false) failed. Logs and warnings go to stderr.

Parts (one tiny random Qwen2-family model from `make_tiny`, shared by all of them):

    bf16_parity           dockrl's `load_model` vs transformers' `AutoModelForCausalLM`, same input ids [4, 64]:
                          max |logit difference| in bf16 and in fp32, the logits' scale (max |logit| of the
                          fp32 reference) and the bf16 difference in units of bf16 epsilon (2**-7) x scale;
                          also each side's bf16 error against its own fp32 logits. Report only, no check.
    dcp_round_trip        a world-size-1 process group and a `TrainEngine` (FSDP2 over a 1-rank mesh; bf16 on
                          CUDA, fp32 on CPU): one policy update, `save_engine` (torch.distributed.checkpoint)
                          and `export_hf`, a fresh engine (`load_weights=False`) + `load_engine`, then one more
                          identical update on both. Checks: the loaded parameters, the second update's metrics
                          and all parameters after it are bitwise equal, and the export holds the weights.
                          On CUDA the updates run with torch.use_deterministic_algorithms (warn only).
    rollout_tokens_per_s  dockrl's `RolloutEngine` vs transformers' `generate` on the device (bf16 on CUDA, fp32
                          on CPU), as `dockrl bench rollout` does: fixed lengths and long-tailed lengths
                          (`sequence_lengths`); best of `repeats` timed runs after a warm-up. Report only.
    switch_offload        `RolloutSwitch` (allgather-swap, world 1, tp 1) around a `TrainEngine` after one
                          optimizer step, offloading optimizer state, grads and params on CUDA (nothing moves on
                          CPU, so offload is off there): two enter/exit cycles, timed, with the CUDA allocator's
                          bytes before, in the rollout layout and after exit. Checks: the parameters are bitwise
                          the same after exit as before enter. Also reports the rollout model's logits against
                          a model built from the training weights (same dtype).
    vllm_update           rollout.backend=vllm (vLLM 0.32.0 in process; skipped, ok, without it): an engine
                          built without weights gets two different weight sets through `load_weights`, each
                          checked on the probe sequence (WeightSyncError past the bound); greedy tokens against
                          dockrl's engine (the share of tokens agreeing from the start: near ties may part them
                          in bf16); tokens/s of both engines, seconds and MiB per update.

Sizes: --quick uses a hidden-64, 2-layer model and a handful of short sequences (under ~30 s on a CPU);
otherwise a hidden-1024, 8-layer model (~100M parameters) and 64 sequences of up to 256 new tokens. With
--device cpu --quick torch runs single-threaded (tiny ops are faster so on shared cores).

--out DIR keeps the model and the checkpoints under DIR/gpu_check/ (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BF16_EPS = 2.0**-7
PARITY_SHAPE = (4, 64)
TRAIN_ROWS = 8
MICRO_BATCH = 2
PER_TOKEN = ["advantages", "ref_logprobs", "old_logprobs"]


@dataclass(frozen=True)
class Sizes:
    """Model and workload sizes of one mode (quick or full)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_sequences: int
    new_tokens: int
    prompt_len: int
    repeats: int


QUICK = Sizes(64, 2, 4, 2, num_sequences=8, new_tokens=16, prompt_len=8, repeats=1)
FULL = Sizes(1024, 8, 16, 4, num_sequences=64, new_tokens=256, prompt_len=32, repeats=2)


@dataclass
class Context:
    """What the parts share: device, sizes, working directory, the model and the process group."""

    device: torch.device
    sizes: Sizes
    work: Path
    _model_dir: Path | None = None
    _mesh: Any = None
    notes: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        """Whether the checks run on a CUDA device."""
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        """TrainEngine precision: bf16 on CUDA, fp32 on CPU."""
        return "bf16" if self.cuda else "fp32"

    @property
    def dtype(self) -> torch.dtype:
        """Inference dtype (rollout engine, switch buffers): bf16 on CUDA, fp32 on CPU."""
        return torch.bfloat16 if self.cuda else torch.float32

    def sync(self) -> None:
        """Wait for the device (a no-op on CPU), so wall times cover the work."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def model_dir(self) -> Path:
        """The tiny Qwen2-family model directory, written once on first use."""
        if self._model_dir is None:
            from dockrl.models.tiny import make_tiny

            s = self.sizes
            self._model_dir = make_tiny(
                self.work / "model",
                family="qwen2",
                hidden_size=s.hidden_size,
                num_layers=s.num_layers,
                num_heads=s.num_heads,
                num_kv_heads=s.num_kv_heads,
                seed=0,
                max_position_embeddings=max(512, s.prompt_len + s.new_tokens),
            )
        return self._model_dir

    def mesh(self):
        """A 1-rank data-parallel mesh over a world-size-1 process group (initialised on first use)."""
        if self._mesh is None:
            from dockrl.parallel.dist import data_parallel_mesh, free_port, init_distributed

            init_distributed(0, 1, "127.0.0.1", free_port(), self.device.type, timeout_s=300)
            self._mesh = data_parallel_mesh(self.device.type, 1)
        return self._mesh

    def fresh_dir(self, name: str) -> Path:
        """`work/name`, emptied first (a stale checkpoint would inflate the byte count)."""
        path = self.work / name
        if path.exists():
            shutil.rmtree(path)
        return path


# ---- helpers ------------------------------------------------------------------------------------------


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in fp32."""
    return (a.float() - b.float()).abs().max().item()


def _dir_bytes(path: Path) -> int:
    """Bytes of all files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """(bitwise equal with the same keys, max |difference| over the common keys)."""
    common = a.keys() & b.keys()
    diff = max((_max_diff(a[n], b[n]) for n in common), default=0.0)
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in common), diff


def _make_rows(vocab: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Ragged policy-update rows (prompt, response, advantages, ref/old log-probs), as in the dp tests."""
    g = torch.Generator().manual_seed(seed)
    batch: dict[str, list[torch.Tensor]] = {k: [] for k in ["prompt_ids", "response_ids", *PER_TOKEN]}
    for i in range(TRAIN_ROWS):
        p, r = 3 + i % 4, 2 + (i * 3) % 7
        batch["prompt_ids"].append(torch.randint(0, vocab, (p,), generator=g))
        batch["response_ids"].append(torch.randint(0, vocab, (r,), generator=g))
        batch["advantages"].append(torch.full((r,), float(torch.randn(1, generator=g))))
        batch["ref_logprobs"].append(-torch.rand(r, generator=g) * 5)
        batch["old_logprobs"].append(-torch.rand(r, generator=g) * 5)
    return batch


def _new_engine(ctx: Context, *, load_weights: bool = True):
    """A trainable TrainEngine on the 1-rank mesh (AdamW lr 1e-3, 10-step schedule)."""
    from dockrl.config import ActorConfig
    from dockrl.engines.train.train_engine import TrainEngine

    return TrainEngine(
        str(ctx.model_dir()),
        device=ctx.device,
        precision=ctx.precision,
        mesh=ctx.mesh(),
        optim=ActorConfig(lr=1e-3),
        total_optimizer_steps=10,
        load_weights=load_weights,
    )


def _update(engine, batch: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """One policy update (clipped surrogate + KL) on all rows of `batch`."""
    from dockrl.config import AlgoConfig, loss_plan
    from dockrl.engines.train.policy_update import policy_update

    return policy_update(
        engine,
        batch,
        list(range(len(batch["prompt_ids"]))),
        PER_TOKEN,
        loss_plan(AlgoConfig(kl_coef=0.05, clip_low=0.2, clip_high=0.28)),
        temperature=1.0,
        micro_batch_size=MICRO_BATCH,
        pad_token_id=0,
        world_size=1,
    )


@contextlib.contextmanager
def _deterministic(enabled: bool):
    """torch.use_deterministic_algorithms(True, warn_only=True) inside the block when `enabled`."""
    if not enabled:
        yield
        return
    before, before_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)


# ---- parts --------------------------------------------------------------------------------------------


@torch.no_grad()
def part_bf16_parity(ctx: Context) -> dict[str, Any]:
    """Logits of dockrl and transformers on the same weights and input ids, in bf16 and fp32."""
    from transformers import AutoModelForCausalLM

    from dockrl.models.hf import load_model, read_config

    path = ctx.model_dir()
    vocab = read_config(path).vocab_size
    ids = torch.randint(0, vocab, PARITY_SHAPE, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    logits: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_model(path, device=ctx.device, dtype=dtype).eval()
        logits["dockrl", dtype] = ours(ids).float()
        del ours
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(ctx.device).eval()
        logits["hf", dtype] = theirs(ids).logits.float()
        del theirs
    bf16, fp32 = torch.bfloat16, torch.float32
    scale = logits["hf", fp32].abs().max().item()
    diff_bf16 = _max_diff(logits["dockrl", bf16], logits["hf", bf16])
    diff_fp32 = _max_diff(logits["dockrl", fp32], logits["hf", fp32])
    unit = BF16_EPS * scale
    return {
        "input_shape": list(PARITY_SHAPE),
        "vocab_size": vocab,
        "logit_scale": scale,
        "max_abs_diff_bf16": diff_bf16,
        "diff_bf16_in_eps": diff_bf16 / unit,
        "max_abs_diff_fp32": diff_fp32,
        "diff_fp32_in_eps": diff_fp32 / unit,
        "dockrl_bf16_vs_fp32_in_eps": _max_diff(logits["dockrl", bf16], logits["dockrl", fp32]) / unit,
        "hf_bf16_vs_fp32_in_eps": _max_diff(logits["hf", bf16], logits["hf", fp32]) / unit,
        "ok": True,
    }


def part_dcp_round_trip(ctx: Context) -> dict[str, Any]:
    """Update, save (DCP) + export, load into a fresh engine, update both again: bitwise equal?"""
    from dockrl.checkpoint.sharded import export_hf, load_engine, save_engine
    from dockrl.models.hf import load_state_dict

    ckpt, hf_dir = ctx.fresh_dir("dcp_ckpt"), ctx.fresh_dir("dcp_hf")
    engine = _new_engine(ctx)
    vocab = engine.args.vocab_size
    with _deterministic(ctx.cuda):
        first = _update(engine, _make_rows(vocab, seed=0))
    saved = engine.full_state_dict()

    ctx.sync()
    start = time.perf_counter()
    save_engine(engine, ckpt)
    ctx.sync()
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    export_hf(engine, hf_dir, tokenizer_dir=str(ctx.model_dir()))
    export_s = time.perf_counter() - start

    engine2 = _new_engine(ctx, load_weights=False)
    ctx.sync()
    start = time.perf_counter()
    load_engine(engine2, ckpt)
    ctx.sync()
    load_s = time.perf_counter() - start
    loaded_equal, loaded_diff = _states_equal(engine2.full_state_dict(), saved)

    exported = load_state_dict(hf_dir)
    export_equal, export_diff = _states_equal(
        exported, {n: t.to(exported[n].dtype) if n in exported else t for n, t in saved.items()}
    )

    batch = _make_rows(vocab, seed=1)
    with _deterministic(ctx.cuda):
        metrics_a = _update(engine, batch)
        metrics_b = _update(engine2, batch)
    params_equal, params_diff = _states_equal(engine.full_state_dict(), engine2.full_state_dict())
    metrics_equal = metrics_a == metrics_b
    checks = {
        "loaded_bitwise_equal": loaded_equal,
        "metrics_bitwise_equal": metrics_equal,
        "params_bitwise_equal": params_equal,
        "export_equal": export_equal,
    }
    return {
        "precision": ctx.precision,
        "num_params": engine.args.num_params(),
        **checks,
        "bitwise_equal": metrics_equal and params_equal,
        "loaded_max_abs_diff": loaded_diff,
        "params_max_abs_diff": params_diff,
        "export_max_abs_diff": export_diff,
        "metrics_first_update": first,
        "metrics_second_update": metrics_a,
        "metrics_second_update_loaded": metrics_b,
        "save_s": save_s,
        "export_s": export_s,
        "load_s": load_s,
        "checkpoint_bytes": _dir_bytes(ckpt),
        "export_bytes": _dir_bytes(hf_dir),
        "deterministic_algorithms": ctx.cuda,
        "ok": all(checks.values()),
    }


def _time_best(ctx: Context, run_once: Callable[[int], None], new_tokens: int, repeats: int) -> float:
    """Warm up with a short run (<= 4 tokens), then the best wall time of `repeats` full runs."""
    run_once(min(4, new_tokens))
    times = []
    for _ in range(repeats):
        ctx.sync()
        start = time.perf_counter()
        run_once(new_tokens)
        ctx.sync()
        times.append(time.perf_counter() - start)
    return min(times)


def _generate_dockrl(model, prompts: torch.Tensor, lengths: list[int]) -> None:
    """Sample len(lengths) sequences with dockrl's RolloutEngine, sequence i stopping after lengths[i]."""
    from dockrl.engines.rollout import Request, RolloutEngine, SamplingParams

    engine = RolloutEngine(model, num_slots=len(prompts), max_seq_len=prompts.shape[1] + max(lengths))
    for index, (prompt, length) in enumerate(zip(prompts.tolist(), lengths)):
        params = SamplingParams(max_new_tokens=length, temperature=1.0, top_p=1.0, top_k=0)
        engine.add(Request(prompt, [index], params, tag=index))
    produced = {c.tag: len(c.generation.token_ids) for c in engine.run()}
    assert [produced[i] for i in range(len(lengths))] == lengths, "dockrl produced other lengths"


@torch.no_grad()
def _generate_hf(model, prompts: torch.Tensor, new_tokens: int) -> None:
    """Sample exactly `new_tokens` tokens per prompt with transformers' generate (eos disabled)."""
    output = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    assert output.shape[1] == prompts.shape[1] + new_tokens, "transformers produced another length"


def part_rollout_tokens_per_s(ctx: Context) -> dict[str, Any]:
    """Tokens/s of dockrl's rollout engine and of transformers' generate, fixed and long-tailed lengths."""
    from transformers import AutoModelForCausalLM

    from dockrl.bench.rollout import sequence_lengths
    from dockrl.models.hf import load_model

    s, path = ctx.sizes, ctx.model_dir()
    ours = load_model(path, device=ctx.device, dtype=ctx.dtype).eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=ctx.dtype).to(ctx.device).eval()
    vocab = ours.args.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (s.num_sequences, s.prompt_len), generator=generator).to(ctx.device)
    out: dict[str, Any] = {
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "model_params": ours.args.num_params(),
        "num_sequences": s.num_sequences,
        "prompt_len": s.prompt_len,
        "new_tokens": s.new_tokens,
        "repeats": s.repeats,
    }
    for mode in ("fixed", "longtail"):
        spec = argparse.Namespace(
            lengths=mode, new_tokens=s.new_tokens, num_sequences=s.num_sequences, seed=0
        )
        out[mode] = _rollout_figures(ctx, ours, theirs, prompts, sequence_lengths(spec))
    out["ok"] = True
    return out


def _rollout_figures(ctx: Context, ours, theirs, prompts: torch.Tensor, lengths: list[int]) -> dict[str, Any]:
    """Tokens/s of both engines for per-sequence `lengths`; throughput counts the requested tokens only."""
    s = ctx.sizes

    def run_dockrl(limit: int) -> None:
        _generate_dockrl(ours, prompts, [min(n, limit) for n in lengths])

    def run_hf(limit: int) -> None:
        # A static batch runs until its longest sequence is done (see dockrl.bench.rollout).
        _generate_hf(theirs, prompts, min(max(lengths), limit))

    dockrl_s = _time_best(ctx, run_dockrl, s.new_tokens, s.repeats)
    hf_s = _time_best(ctx, run_hf, s.new_tokens, s.repeats)
    tokens = sum(lengths)
    return {
        "mean_new_tokens": tokens / len(lengths),
        "max_new_tokens": max(lengths),
        "tokens_per_s_dockrl": tokens / dockrl_s,
        "tokens_per_s_hf": tokens / hf_s,
        "ratio": hf_s / dockrl_s,
    }


def _memory(ctx: Context) -> int | None:
    """CUDA allocator bytes in use (None on CPU)."""
    if not ctx.cuda:
        return None
    torch.cuda.synchronize(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def part_switch_offload(ctx: Context) -> dict[str, Any]:
    """Time RolloutSwitch enter/exit with offload after one optimizer step; parameters restored bitwise?"""
    from dockrl.engines.reshard.switch import OffloadFlags, RolloutSwitch
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import materialize
    from dockrl.parallel.dist import inference_mesh

    engine = _new_engine(ctx)
    _update(engine, _make_rows(engine.args.vocab_size, seed=0))
    before = engine.full_state_dict()
    # Reference logits of the training weights cast to the rollout dtype, to compare the rollout model with.
    ids = torch.randint(0, engine.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(ctx.device)
    with torch.no_grad():
        reference = materialize(
            lambda: Transformer(engine.args), before, "<training weights>", device=ctx.device, dtype=ctx.dtype
        ).eval()
        ref_logits = reference(ids).float()
    del reference
    gc.collect()

    flags = (
        OffloadFlags(optimizer=True, grads=True, params=True)
        if ctx.cuda
        else OffloadFlags(False, False, False)
    )
    switch = RolloutSwitch(
        engine,
        rank=0,
        world=1,
        tp_infer=1,
        infer_group=inference_mesh(ctx.device.type, 1, 1).get_group("tp"),
        bucket_bytes=None,
        dtype=ctx.dtype,
        offload=flags,
    )
    cycles = []
    logits_diff = None
    for cycle in range(2):
        row: dict[str, Any] = {"memory_before": _memory(ctx)}
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        ctx.sync()
        start = time.perf_counter()
        entered = switch.enter()
        ctx.sync()
        row["enter_s"] = time.perf_counter() - start
        row["offloaded_bytes"] = int(entered["offloaded_bytes"])
        row["memory_rollout"] = _memory(ctx)
        row["memory_peak_enter"] = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
        if cycle == 0:
            with torch.no_grad():
                logits_diff = _max_diff(switch.model(ids), ref_logits)
        ctx.sync()
        start = time.perf_counter()
        switch.exit()
        ctx.sync()
        row["exit_s"] = time.perf_counter() - start
        row["memory_after"] = _memory(ctx)
        cycles.append(row)
    restored, restored_diff = _states_equal(engine.full_state_dict(), before)
    return {
        "offload": {"optimizer": flags.optimizer, "grads": flags.grads, "params": flags.params},
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "params_restored": restored,
        "params_max_abs_diff": restored_diff,
        "rollout_logits_max_abs_diff": logits_diff,
        "bucket_bytes": switch.bucket_bytes,
        "inference_shard_bytes": switch.inference_shard_bytes,
        "enter_s": cycles[0]["enter_s"],
        "exit_s": cycles[0]["exit_s"],
        "cycles": cycles,
        "ok": restored,
    }


def part_vllm_update(ctx: Context) -> dict[str, Any]:
    """rollout.backend=vllm in this process: two weight updates into a vLLM engine built without weights, each
    checked on the probe sequence; greedy tokens against dockrl's engine on the same weights; a fresh engine's
    outputs against the updated one's; tokens/s of both engines; seconds per update. Skipped (ok) when vLLM
    0.32.0 is not installed."""
    import time as _time

    from dockrl.algos.logprobs import token_logprobs
    from dockrl.engines.rollout import Request, RolloutEngine, SamplingParams
    from dockrl.engines.rollout.sampler import generate_with
    from dockrl.engines.rollout.vllm_backend import (
        PROBE_TOL,
        VllmBackend,
        VllmSettings,
        kv_cache_bytes,
        vllm_problem,
    )
    from dockrl.models.hf import load_model
    from dockrl.models.tiny import make_tiny, peaked_state_dict

    problem = vllm_problem()
    if problem is not None:
        return {"ok": True, "skipped": problem}
    s = ctx.sizes
    # vLLM's CPU attention needs a head size of 32 or more: the quick model gets 2 heads of 32.
    heads = 2 if s.hidden_size // s.num_heads < 32 else s.num_heads
    path = make_tiny(
        ctx.work / "vllm_model",
        family="qwen2",
        hidden_size=s.hidden_size,
        num_layers=s.num_layers,
        num_heads=heads,
        num_kv_heads=min(s.num_kv_heads, heads),
        seed=0,
        max_position_embeddings=max(512, s.prompt_len + s.new_tokens),
    )
    max_len = s.prompt_len + s.new_tokens
    model = load_model(path, device=ctx.device, dtype=ctx.dtype).eval()
    settings = VllmSettings(
        model_dir=str(path),
        dtype=ctx.dtype,
        max_model_len=max_len,
        max_num_seqs=s.num_sequences,
        memory_utilization=0.3,
        device_type=ctx.device.type,
        kv_cache_bytes=None if ctx.cuda else kv_cache_bytes(model.args, s.num_sequences, max_len, ctx.dtype),
    )
    start = _time.perf_counter()
    engine = VllmBackend(settings, name="gpu_check")
    out: dict[str, Any] = {
        "build_s": _time.perf_counter() - start,
        "dtype": str(ctx.dtype).removeprefix("torch."),
    }
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.args.vocab_size, (s.num_sequences, s.prompt_len), generator=generator)
    greedy = SamplingParams(max_new_tokens=s.new_tokens, temperature=0.0)
    ids = engine.probe_ids()
    for seed in (1, 2):
        weights = {k: v.to(ctx.device, ctx.dtype) for k, v in peaked_state_dict(path, seed).items()}
        model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            logits = model(ids[None].to(ctx.device))[0, :-1].float()
        reference = token_logprobs(logits, ids[1:].to(ctx.device))
        report = engine.load_weights(weights.items(), reference)  # raises WeightSyncError past the bound
        ours = generate_with(engine, prompts.tolist(), greedy, [0] * len(prompts))
        own = RolloutEngine(model, num_slots=len(prompts), max_seq_len=max_len)
        for i, prompt in enumerate(prompts.tolist()):
            own.add(Request(prompt, [0], greedy, tag=i))
        theirs = {c.tag: c.generation for c in own.run()}
        agreed = [
            _common_prefix(o.token_ids.tolist(), theirs[i].token_ids.tolist()) for i, o in enumerate(ours)
        ]
        out[f"update_{seed}"] = {
            "seconds": report["seconds"],
            "mb": report["bytes"] / 2**20,
            "probe_abs_diff": report["probe_abs_diff"],
            "greedy_prefix_agreement": sum(agreed) / (len(prompts) * s.new_tokens),
            "sequences_identical": sum(a == s.new_tokens for a in agreed) / len(prompts),
        }
    fixed = [s.new_tokens] * s.num_sequences
    sampled = SamplingParams(max_new_tokens=s.new_tokens, temperature=1.0)
    seeds = list(range(len(prompts)))
    vllm_s = _time_best(
        ctx,
        lambda n: generate_with(engine, prompts.tolist(), _limit(sampled, n), seeds),
        s.new_tokens,
        s.repeats,
    )
    dockrl_s = _time_best(
        ctx,
        lambda n: _generate_dockrl(model, prompts.to(ctx.device), [n] * len(prompts)),
        s.new_tokens,
        s.repeats,
    )
    out["tokens_per_s_vllm"] = sum(fixed) / vllm_s
    out["tokens_per_s_dockrl"] = sum(fixed) / dockrl_s
    out["probe_tol"] = PROBE_TOL[ctx.dtype]
    engine.close()
    out["ok"] = True
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two sequences share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _limit(params, new_tokens: int):
    import dataclasses

    return dataclasses.replace(params, max_new_tokens=new_tokens)


PARTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "bf16_parity": part_bf16_parity,
    "dcp_round_trip": part_dcp_round_trip,
    "rollout_tokens_per_s": part_rollout_tokens_per_s,
    "switch_offload": part_switch_offload,
    "vllm_update": part_vllm_update,
}


# ---- driver -------------------------------------------------------------------------------------------


def _emit(record: dict[str, Any], stream) -> None:
    """One JSON line on `stream` (the real stdout), flushed at once."""
    stream.write(json.dumps(record, default=str) + "\n")
    stream.flush()


def run_part(name: str, fn: Callable[[Context], dict[str, Any]], ctx: Context, stream) -> dict[str, Any]:
    """Run one part with stdout sent to stderr; its record, or {"part", "error"} when it raised."""
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            record = {"part": name, **fn(ctx)}
    except Exception as exc:  # one part's failure must not stop the others
        traceback.print_exc(file=sys.stderr)
        record = {"part": name, "error": f"{type(exc).__name__}: {exc}"}
    record["seconds"] = time.perf_counter() - start
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    _emit(record, stream)
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument("--quick", action="store_true", help="tiny model, few short sequences (smoke test)")
    parser.add_argument("--out", default=None, help="keep models and checkpoints under OUT/gpu_check/")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of the parts")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts, print one JSON line each and a summary; 0 when all passed."""
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Deterministic cuBLAS for the bitwise DCP comparison; read when the first cuBLAS handle is created.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu" and args.quick:
        torch.set_num_threads(1)
    stdout = sys.stdout
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"gpu_check: unknown parts {unknown}; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.out is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_check_")))
        else:
            work = Path(args.out) / "gpu_check"
            work.mkdir(parents=True, exist_ok=True)
        device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
        ctx = Context(device=device, sizes=QUICK if args.quick else FULL, work=work)
        records, ray_imported = [], False
        for name in names:
            records.append(run_part(name, PARTS[name], ctx, stdout))
            # vLLM imports Ray when it finds it (it is on a CPU test machine, not the GPU one): only dockrl's
            # own parts must not need it.
            ray_imported = ray_imported or (name != "vllm_update" and "ray" in sys.modules)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    failed = [r["part"] for r in records if "error" in r or not r.get("ok", False)]
    # the GPU machine has no Ray: nothing of dockrl's here may need it (ray_imported, set above)
    if ray_imported:
        failed.append("ray_imported")
    import transformers

    _emit(
        {
            "part": "summary",
            "ok": not failed,
            "failed": failed,
            "parts": names,
            "ray_imported": ray_imported,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda" and torch.cuda.is_available()
            else "cpu",
            "quick": args.quick,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "seconds": time.perf_counter() - start,
        },
        stdout,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
