"""`dockrl bench reshard`: peak memory of the training -> inference switch, bucketed vs two baselines.

Spawns dp x tp_train processes (gloo on CPU, NCCL on CUDA) holding a random >= 50M-parameter llama-shaped
model after one optimizer step (params, grads, Adam state: the steady state), then on every rank measures
the extra peak over that steady state of (1) dockrl's bucketed allgather-swap `RolloutSwitch.enter()`,
(2) the streaming switch of verl-style weight sync (one whole tensor at a time through a flat staging bucket
of the same size, handed over when full) and (3) the full-state-dict switch that gathers every parameter on
every rank first. CPU: process RSS high-water mark
(reset through /proc/self/clear_refs; glibc's mmap threshold is pinned so freed tensors leave RSS); CUDA:
the caching allocator's peak. Offload moves nothing on CPU, so the inference buffers count in full. Also
reports `dockrl plan`'s prediction of the bucketed extra peak and its error.

MoE (`--experts N`): a Qwen3-MoE of the same shape whose every MLP is N experts (top-2, width hidden / 2),
trained with expert parallelism `--ep` (experts split over ep ranks, FSDP2 over dp / ep of them); the switch
gathers experts over ep and edp into the same inference buffers (experts whole in inference). Also reported:
each rank's steady-state training bytes (parameters, gradients, AdamW state: the max over ranks), the extra
peak of a training step over that steady state (FSDP2's gathered layers, activations: expert parallelism
gathers E/ep experts per MoE layer where plain FSDP2 gathers all E), and the all-to-all bytes a rank sent in
the first training step (forward and backward).
"""

from __future__ import annotations

import argparse

from dockrl.bench.steady_state import proc_status, rss_reset, take_one_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Layouts and model size."""
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp-train", type=int, default=1)
    parser.add_argument("--tp-infer", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--experts", type=int, default=0, help="MoE: experts per layer (0: a dense llama)")
    parser.add_argument("--ep", type=int, default=1, help="MoE: expert-parallel degree of training")
    parser.add_argument("--bucket-mb", type=float, default=None, help="default: the largest tensor")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")


def _measure(switch, device: str, naive: bool = False, baseline: str | None = None) -> int:
    extra = _extra_peak(lambda: switch.enter(naive=naive, baseline=baseline), device)
    switch.exit()
    return extra


def _extra_peak(action, device: str) -> int:
    """Bytes `action()` adds at its peak over what was held before it."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        action()
        return torch.cuda.max_memory_allocated() - base
    base = rss_reset()
    action()
    return proc_status("VmHWM") - base


def _worker(
    rank: int, world: int, port: int, args: argparse.Namespace, model_dir: str, out: str, leave
) -> None:
    import os
    import time

    import torch

    from dockrl.config import ActorConfig
    from dockrl.engines.reshard.switch import OffloadFlags, RolloutSwitch
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import inference_mesh, init_distributed, training_mesh
    from dockrl.parallel.expert_parallel import ALL_TO_ALL_BYTES

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # one GPU per spawned rank
    device = init_distributed(rank, world, "127.0.0.1", port, args.device, timeout_s=600)
    train_mesh = training_mesh(args.device, args.dp, args.tp_train)
    engine = TrainEngine(
        model_dir, device=device, precision="fp32", mesh=train_mesh, optim=ActorConfig(), ep=args.ep
    )
    start = time.perf_counter()
    take_one_step(engine, args.dp, seed=rank // args.tp_train)
    train_s = time.perf_counter() - start
    all_to_all = ALL_TO_ALL_BYTES[0]
    step_peak = _extra_peak(lambda: take_one_step(engine, args.dp, seed=rank // args.tp_train), args.device)
    group = inference_mesh(args.device, world, args.tp_infer).get_group("tp")
    bucket = None if args.bucket_mb is None else int(args.bucket_mb * 2**20)
    switch = RolloutSwitch(
        engine,
        rank=rank,
        world=world,
        tp_infer=args.tp_infer,
        infer_group=group,
        bucket_bytes=bucket,
        dtype=torch.float32,
        offload=OffloadFlags(),
    )
    switch.enter()  # warm-up: first-touch allocations and collective setup are not the switch's cost
    switch.exit()
    start = time.perf_counter()
    bucketed = _measure(switch, args.device, naive=False)
    switch_s = time.perf_counter() - start
    streaming = _measure(switch, args.device, baseline="streaming")
    naive = _measure(switch, args.device, naive=True)
    result = {
        "bucketed": bucketed,
        "naive": naive,
        "streaming": streaming,
        "bucket": switch.bucket_bytes,
        "shard": switch.inference_shard_bytes,
        "train_s": train_s,
        "switch_s": switch_s,
        "train_state": _train_state_bytes(engine),
        "all_to_all": all_to_all,
        "step_peak": step_peak,
    }
    results = [None] * world
    torch.distributed.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out)
    leave(rank)


def _train_state_bytes(engine) -> int:
    """This rank's parameters, gradients and optimizer state (local shards), in bytes."""
    from torch.distributed.tensor import DTensor

    def size(t) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    total = 0
    for param in engine.model.parameters():
        total += size(param) + (size(param.grad) if param.grad is not None else 0)
        for value in engine.optimizer.state.get(param, {}).values():
            total += size(value) if value.dim() else 0
    return total


def run(args: argparse.Namespace) -> dict:
    """Spawn the ranks, measure, and summarise (max over ranks)."""
    import os
    import tempfile

    import torch

    from dockrl.models.config import ModelArgs
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import save_model
    from dockrl.parallel.dist import free_port
    from dockrl.parallel.memory_plan import PlanInput, plan
    from dockrl.parallel.spawn import spawn_ranks
    from dockrl.recipes.preflight import resolve_device

    args.device = resolve_device(args.device, "--device")
    world = args.dp * args.tp_train
    moe = (
        dict(num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=args.hidden_size // 2)
        if args.experts
        else {}
    )
    model_args = ModelArgs(
        family="qwen3_moe" if args.experts else "llama",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=3 * args.hidden_size,
        num_layers=args.num_layers,
        num_heads=8,
        num_kv_heads=8,
        head_dim=args.hidden_size // 8,
        qk_norm=bool(args.experts),
        **moe,
    )
    # A freed tensor must leave RSS for the CPU peak to mean anything: pin glibc's mmap threshold at 64 KiB.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as tmp:
        model = Transformer(model_args)
        model.init_weights(0)
        save_model(model, model_args, tmp)
        del model
        out = os.path.join(tmp, "results.pt")
        spawn_ranks(_worker, world, free_port(), args, tmp, out)
        results = torch.load(out, weights_only=False)
    question = PlanInput(
        model_args, args.dp, args.tp_train, args.tp_infer, infer_bytes=4, bucket_bytes=results[0]["bucket"]
    )
    predicted = plan(question)
    bucketed = max(r["bucketed"] for r in results)
    naive = max(r["naive"] for r in results)
    streaming = max(r["streaming"] for r in results)
    target = max(r["bucket"] + r["shard"] for r in results)
    return {
        "peak_bytes_bucketed": bucketed,
        "peak_bytes_naive": naive,
        "naive_over_bucketed": naive / max(bucketed, 1),
        "peak_bytes_streaming": streaming,
        "streaming_over_bucketed": streaming / max(bucketed, 1),
        "bucketed_within_streaming": bucketed <= streaming,
        "bucket_bytes": results[0]["bucket"],
        "model_bytes": model_args.num_params() * 4,
        "inference_shard_bytes": max(r["shard"] for r in results),
        "target_bytes": target,
        "within_target": bucketed <= target,
        "planned_extra_bytes": int(predicted["switch_extra_bytes"]),
        "plan_error": predicted["switch_extra_bytes"] / max(bucketed, 1) - 1,
        "switch_s": max(r["switch_s"] for r in results),
        "num_params": model_args.num_params(),
        "train_state_bytes": max(r["train_state"] for r in results),
        "all_to_all_bytes": max(r["all_to_all"] for r in results),
        "train_step_extra_peak_bytes": max(r["step_peak"] for r in results),
        "layout": f"dp={args.dp} tp_train={args.tp_train} ep={args.ep} -> tp_infer={args.tp_infer}"
        + (f" ({args.experts} experts)" if args.experts else ""),
    }
