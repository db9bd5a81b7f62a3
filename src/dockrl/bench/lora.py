"""`dockrl bench lora`: full fine-tuning against LoRA on one model, side by side, per data-parallel rank.

For each mode (full, lora) a fresh set of `--dp` spawned gloo ranks builds the actor's training engine
(FSDP2, `--precision`) on a random Qwen2-shaped model of about 58M parameters (hidden 512, 8 layers, a 32k
vocabulary), plus what the reference policy costs: full fine-tuning loads a second, frozen copy of the model
(as the actor does when algo.kl_coef > 0); LoRA runs the same weights with the adapters off (no copy). Then it
times reference log-probs and `--steps` train steps of `--rows` rows of `--tokens` tokens per rank, and reports:

  trainable_params      parameters the optimizer updates
  optimizer_state_mb    AdamW moments (all ranks together)
  peak_rss_mb           the rank's peak resident memory above the process's before the engines (max over ranks)
  reference_mb          resident memory the reference policy added (the second engine, or nothing)
  model_state_mb        per rank: parameters, gradients, AdamW state and the reference's parameters held
                        after a step (the part LoRA shrinks; peak_rss_mb adds activations and the process)
  step_s                median seconds of a train step (rank 0)
  sync_mb, sync_s       one weight sync to a separate rollout replica, through the real code path: a
                        one-rank trainer (`RolloutSwitch.broadcast_weights`, or `broadcast_adapters` under
                        LoRA) sends to a `ReplicaWeights` in another process over gloo; bytes per update and
                        the median seconds over --steps syncs (send to received). Every weight in the rollout
                        dtype (full), the adapters only in fp32 (lora)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

MODEL_SHAPE: dict[str, Any] = dict(
    hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64
)
SMALL_SHAPE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model size, layout and workload."""
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (spawned processes)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--target-modules", default="all-linear", help="all-linear or a comma list")
    parser.add_argument("--rows", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per row (a quarter of them prompt)")
    parser.add_argument("--steps", type=int, default=3, help="train steps timed (after one warm-up step)")
    parser.add_argument("--precision", default="auto", help="auto (bf16 on CPUs that compute it), fp32, bf16")
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--small", action="store_true", help="a 2-layer hidden-64 model (a quick check)")


def run(args: argparse.Namespace) -> list[dict]:
    """One row per mode."""

    from dockrl.models.config import ModelArgs
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import save_model
    from dockrl.parallel.dist import free_port
    from dockrl.parallel.spawn import spawn_ranks
    from dockrl.recipes.preflight import resolve_precision

    precision = resolve_precision(args.precision, "cpu", key="--precision")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-lora-") as tmp:
        shape = SMALL_SHAPE if args.small else MODEL_SHAPE
        model_args = ModelArgs(family="qwen2", vocab_size=args.vocab_size, attention_bias=True, **shape)
        model = Transformer(model_args)
        model.init_weights(seed=0)
        save_model(model, model_args, Path(tmp) / "model")
        num_params = sum(p.numel() for p in model.parameters())
        del model
        for mode in args.modes.split(","):
            out = Path(tmp) / f"{mode}.json"
            spawn_ranks(
                _rank, args.dp, free_port(), str(Path(tmp) / "model"), mode, precision, vars(args), str(out)
            )
            result = json.loads(out.read_text())
            spawn_ranks(
                _sync_rank,
                2,
                free_port(),
                free_port(),
                str(Path(tmp) / "model"),
                mode,
                precision,
                vars(args),
                str(out),
            )
            result.update(json.loads(out.read_text()))
            result.update(mode=mode, model_params=num_params, precision=precision, dp=args.dp)
            rows.append(result)
    return rows


def _rss_mb(field: str = "VmHWM") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _rank(
    rank: int, world: int, port: int, model_dir: str, mode: str, precision: str, opts: dict, out: str, leave
):
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.config import ActorConfig
    from dockrl.engines.train.batch import make_micro_batch
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.lora import LoraSpec, resolve_targets
    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=600)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    targets = opts["target_modules"]
    spec = None
    if mode == "lora":
        names = targets if targets == "all-linear" else targets.split(",")
        spec = LoraSpec(opts["rank"], opts["alpha"], 0.0, resolve_targets(names))
    base_rss = _rss_mb("VmRSS")
    engine = TrainEngine(
        model_dir, device="cpu", precision=precision, mesh=mesh, optim=ActorConfig(), lora=spec
    )
    before_ref = _rss_mb("VmRSS")
    reference = None
    if spec is None:  # full fine-tuning keeps a frozen copy as the KL reference
        reference = TrainEngine(model_dir, device="cpu", precision=precision, mesh=mesh, trainable=False)
    reference_mb = _rss_mb("VmRSS") - before_ref
    g = torch.Generator().manual_seed(rank)
    prompt_len = opts["tokens"] // 4
    prompts = [torch.randint(0, opts["vocab_size"], (prompt_len,), generator=g) for _ in range(opts["rows"])]
    responses = [
        torch.randint(0, opts["vocab_size"], (opts["tokens"] - prompt_len,), generator=g)
        for _ in range(opts["rows"])
    ]
    mb = make_micro_batch(prompts, responses, pad_token_id=0)

    def loss_fn(out, mb):
        logp, _ = out
        return -(logp * mb.response_mask).sum() / mb.response_mask.sum(), {}

    with torch.no_grad():  # the reference pass: a second engine, or the same one with adapters off
        if reference is not None:
            reference.token_stats(mb, 1.0)
        else:
            with engine.adapters_off():
                engine.token_stats(mb, 1.0)
    times = []
    for _ in range(opts["steps"] + 1):
        start = time.perf_counter()
        engine.train_step([mb], loss_fn, forward=lambda mb: engine.token_stats(mb, 1.0))
        times.append(time.perf_counter() - start)
    assert engine.optimizer is not None  # a trainable engine
    state_bytes = torch.tensor(
        [
            float(
                sum(
                    v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                    for s in engine.optimizer.state.values()
                    for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                )
            )
        ]
    )
    dist.all_reduce(state_bytes)
    peaks: list[Any] = [None] * world  # filled by all_gather_object
    dist.all_gather_object(peaks, _rss_mb() - base_rss)
    states: list[Any] = [None] * world
    dist.all_gather_object(states, _model_state_bytes(engine, reference))
    trainable = sum(
        int(torch.Size(engine.global_shapes[n]).numel())
        for n, p in engine.model.named_parameters()
        if p.requires_grad
    )
    if rank == 0:
        result = {
            "trainable_params": trainable,
            "optimizer_state_mb": float(state_bytes) / 2**20,
            "peak_rss_mb": max(peaks),
            "model_state_mb": max(states) / 2**20,
            "reference_mb": reference_mb,
            "step_s": statistics.median(times[1:]),
        }
        Path(out).write_text(json.dumps(result))
    leave(rank)


def _local_bytes(tensor) -> int:
    return int(tensor.to_local().nbytes if hasattr(tensor, "to_local") else tensor.nbytes)


def _model_state_bytes(engine, reference) -> int:
    """This rank's parameters, gradients, optimizer state and reference parameters."""
    import torch

    total = 0
    for param in engine.model.parameters():
        total += _local_bytes(param) + (_local_bytes(param.grad) if param.grad is not None else 0)
    for state in engine.optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    if reference is not None:
        total += sum(_local_bytes(p) for p in reference.model.parameters())
    return total


def _sync_rank(
    rank: int,
    world: int,
    port: int,
    sync_port: int,
    model_dir: str,
    mode: str,
    precision: str,
    opts: dict,
    out: str,
    leave,
):
    """Rank 0: a one-rank trainer engine that sends its weights (or adapters) --steps + 1 times; rank 1: a
    separate rollout replica's ReplicaWeights that receives them. Rank 0 adds sync_mb and sync_s to `out`."""
    import statistics
    import time

    import torch

    from dockrl.config import ActorConfig
    from dockrl.engines.reshard.switch import RolloutSwitch
    from dockrl.engines.rollout.replica_weights import ReplicaWeights
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.hf import read_config
    from dockrl.models.lora import LoraSpec, resolve_targets
    from dockrl.parallel.dist import init_distributed, side_group

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=600)
    group = side_group("127.0.0.1", sync_port, rank, world, timeout_s=600)
    spec = None
    if mode == "lora":
        targets = opts["target_modules"]
        names = targets if targets == "all-linear" else targets.split(",")
        spec = LoraSpec(opts["rank"], opts["alpha"], 0.0, resolve_targets(names))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    times, sent = [], 0
    if rank == 0:
        engine = TrainEngine(model_dir, device="cpu", precision=precision, optim=ActorConfig(), lora=spec)
        switch = RolloutSwitch(
            engine, rank=0, world=1, tp_infer=1, infer_group=None, bucket_bytes=None, dtype=dtype
        )
        send = switch.broadcast_weights if spec is None else switch.broadcast_adapters
        for _ in range(opts["steps"] + 1):
            torch.distributed.barrier()
            start = time.perf_counter()
            sent = send(group)
            torch.distributed.barrier()  # the replica has it all
            times.append(time.perf_counter() - start)
    else:
        replica = ReplicaWeights(
            read_config(model_dir),
            model_dir,
            dtype=dtype,
            device=torch.device("cpu"),
            bucket_bytes=None,
            lora=spec,
            lead=1,
        )
        for version in range(opts["steps"] + 1):
            torch.distributed.barrier()
            replica.receive(version, group)
            torch.distributed.barrier()
    if rank == 0:
        result = json.loads(Path(out).read_text())
        result.update(sync_mb=sent / 2**20, sync_s=statistics.median(times[1:]))
        Path(out).write_text(json.dumps(result))
    leave(rank)
