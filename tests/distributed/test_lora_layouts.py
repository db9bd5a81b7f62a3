"""LoRA across processes (gloo ranks): tensor-parallel adapters, FSDP2 x tp engines and the switch give the single process's numbers; adapter-only sync to replicas keeps every version."""

import torch

from dockrl.models import ModelArgs, Transformer
from dockrl.models.hf import save_model
from dockrl.models.lora import (
    LINEAR_NAMES,
    LoraSpec,
    adapter_state,
    adapters_disabled,
    apply_lora,
    lora_layers,
    merge_into,
)

VOCAB = 128


def tiny_args(family: str = "qwen2") -> ModelArgs:
    return ModelArgs(
        family=family,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=64,
    )


def tiny_model(family: str = "qwen2", seed: int = 0) -> Transformer:
    model = Transformer(tiny_args(family))
    model.init_weights(seed=seed, std=0.2)
    return model.eval()


def randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    """Nonzero B (a fresh adapter has B = 0 and changes nothing), so the adapters show in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.copy_(0.3 * torch.randn(layer.lora_B.shape, generator=generator))


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=LINEAR_NAMES)


def _lora_grads(model: Transformer, tp_group, tp: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss = <hidden states, fixed weights> over a batch; returns it and every adapter's whole gradient.

    Under tp the final norm's output passes copy_to_tp, which sums the tp ranks' gradients (each rank's LM
    head scores its vocab slice, a partial loss): a loss that every rank computes whole counts 1/tp per rank."""
    import torch.distributed as dist

    from dockrl.models.tp_plan import shard_dim
    from dockrl.parallel.layout import Placement, full_tensor

    model.train()
    hidden = model.hidden_states(IDS, None, None)  # [B, T, H], whole on every tp rank
    probe = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7))
    loss = (hidden * probe).sum()
    (loss / tp).backward()
    grads = {
        name: full_tensor(
            p.grad, Placement(shard_dim(name), dist.get_rank(tp_group) if tp > 1 else 0, tp, tp_group)
        )
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return float(loss.detach()), grads


def _tp_worker(rank: int, world: int, port: int, out_path: str, leave) -> None:
    import torch.distributed as dist

    from dockrl.parallel.dist import init_distributed
    from dockrl.parallel.tensor_parallel import parallelize

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {}
    for family in ("qwen2", "qwen3"):
        model = tiny_model(family)
        apply_lora(model, SPEC)
        randomize_adapters(model, seed=5)
        with torch.no_grad():  # nonzero A too, so the row-parallel split of A is exercised
            for _, layer in lora_layers(model):
                layer.lora_A.mul_(3.0)
        reference = _lora_grads(model, None, 1)
        model.zero_grad(set_to_none=True)
        parallelize(model, rank, world, dist.group.WORLD)
        results[family] = (reference, _lora_grads(model, dist.group.WORLD, world))
        with torch.no_grad(), adapters_disabled(model):
            base = tiny_model(family)
            results[family + "/off"] = float(
                (model.hidden_states(IDS, None, None) - base.hidden_states(IDS, None, None)).abs().max()
            )
    if rank == 0:
        torch.save(results, out_path)
    leave(rank)


LORA_LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (dp, tp) against (1, 1)


def _engine_update(model_dir: str, idx: list[int], dp: int, mesh, precision: str = "fp32"):
    """One LoRA train step on rows idx (loss: mean negative log-prob of the response tokens over all ranks'
    tokens); returns (adapter gradients, whole; dtypes of the parameters; optimizer's parameter count)."""
    from dockrl.config import ActorConfig
    from dockrl.engines.train.batch import make_micro_batch
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.layout import full_tensor

    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=LINEAR_NAMES)
    engine = TrainEngine(
        model_dir, device="cpu", precision=precision, mesh=mesh, optim=ActorConfig(lr=1e-2), lora=spec
    )
    with torch.no_grad():  # nonzero B so every adapter gradient is nonzero
        for name, param in engine.model.named_parameters():
            if name.endswith("lora_B"):
                local = param.to_local() if hasattr(param, "to_local") else param
                local.fill_(0.05)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (3 + i % 4,), generator=g) for i in range(8)]
    responses = [torch.randint(0, 256, (2 + (i * 3) % 7,), generator=g) for i in range(8)]
    total = sum(len(r) for r in responses)
    mb = make_micro_batch([prompts[i] for i in idx], [responses[i] for i in idx], pad_token_id=0)

    def loss_fn(out, mb):
        logp, _ = out
        return -(logp * mb.response_mask).sum() * dp / total, {}

    engine.train_step([mb], loss_fn, forward=lambda mb: engine.token_stats(mb, 1.0))
    grads = {
        name: full_tensor(p.grad, engine.placement(name)).detach().clone()
        for name, p in engine.model.named_parameters()
        if p.requires_grad
    }
    frozen_grads = [
        n for n, p in engine.model.named_parameters() if not p.requires_grad and p.grad is not None
    ]
    dtypes = {
        str(p.dtype) + ("/trainable" if p.requires_grad else "/frozen") for p in engine.model.parameters()
    }
    num_optimized = sum(len(group["params"]) for group in engine.optimizer.param_groups)
    return grads, frozen_grads, dtypes, num_optimized


def _engine_worker(rank: int, world: int, port: int, model_dir: str, out_path: str, leave) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {}
    for dp, tp in LORA_LAYOUTS:
        mesh = init_device_mesh("cpu", (world // (dp * tp), dp, tp), mesh_dim_names=("rep", "dp", "tp"))
        per_rank, dp_rank = 8 // dp, mesh["dp"].get_local_rank()
        idx = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        results[(dp, tp)] = _engine_update(model_dir, idx, dp, mesh["dp", "tp"])
    results["bf16"] = _engine_update(
        model_dir,
        list(range(4 * (rank % 2), 4 * (rank % 2) + 4)),
        2,
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))["dp"],
        "bf16",
    )
    if rank == 0:
        torch.save(results, out_path)
    leave(rank)


SWITCH_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4)]  # (tp_train, tp_infer) on 4 ranks


def _switch_pair(rank: int, world: int, model_dir: str, tp_train: int, tp_infer: int) -> dict:
    """A LoRA engine with nonzero adapters enters the inference layout: each inference weight must be this
    rank's slice of W + s B A (merged from the whole tensors here); exit restores training state bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.config import ActorConfig
    from dockrl.engines.reshard.switch import RolloutSwitch
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.layout import Layout, full_tensor

    spec = LoraSpec(
        rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "o_proj", "up_proj", "down_proj")
    )
    mesh = init_device_mesh("cpu", (world // tp_train, tp_train), mesh_dim_names=("dp", "tp"))
    engine = TrainEngine(model_dir, device="cpu", precision="fp32", mesh=mesh, optim=ActorConfig(), lora=spec)
    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            if name.endswith("lora_B"):
                param.to_local().uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(rank))
    full = {
        n: full_tensor(p, engine.placement(n)).detach().clone() for n, p in engine.model.named_parameters()
    }
    before = {n: p.to_local().clone() for n, p in engine.model.named_parameters()}
    infer_mesh = init_device_mesh("cpu", (world // tp_infer, tp_infer), mesh_dim_names=("replica", "tp"))
    switch = RolloutSwitch(
        engine,
        rank=rank,
        world=world,
        tp_infer=tp_infer,
        infer_group=infer_mesh.get_group("tp"),
        bucket_bytes=None,
        dtype=torch.float32,
    )
    switch.enter()
    layout, worst, merged = Layout(world, tp_infer), 0.0, 0
    for name, param in switch.model.named_parameters():
        weight = full[name]
        expected = merge_into(name, weight, full, spec.scaling)
        merged += not torch.equal(expected, weight)
        dim, start, end = layout.shard_slice(name, tuple(weight.shape), rank)
        if dim is not None:
            expected = expected.narrow(dim, start, end - start)
        # Both sides: W + s (B A) in fp32, B A a dot product of r terms (its chunking may differ): at most
        # r + 2 roundings of the magnitudes |W| + s |B| |A|, each of relative size 2^-24.
        module = name.removesuffix(".weight")
        magnitude = weight.abs()
        if f"{module}.lora_A" in full:
            magnitude = magnitude + spec.scaling * (
                full[f"{module}.lora_B"].abs() @ full[f"{module}.lora_A"].abs()
            )
        if dim is not None:
            magnitude = magnitude.narrow(dim, start, end - start)
        bound = (spec.rank + 2) * 2.0**-24 * magnitude
        worst = max(worst, float(((param - expected).abs() - bound).max()))
    switch.exit()
    bitwise = all(torch.equal(before[n], p.to_local()) for n, p in engine.model.named_parameters())
    return {"excess": worst, "merged": merged, "bitwise": bitwise}


def _switch_worker(rank: int, world: int, port: int, model_dir: str, out_path: str, leave) -> None:
    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {pair: _switch_pair(rank, world, model_dir, *pair) for pair in SWITCH_PAIRS}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)
    leave(rank)


def _sync_worker(rank: int, world: int, port: int, sync_port: int, base: str, out: str, leave) -> None:
    """Rank 0 a LoRA trainer engine that sends three adapter versions; rank 1 a replica that stages them."""
    from dockrl.config.schema import OptimConfig
    from dockrl.engines.reshard.switch import RolloutSwitch
    from dockrl.engines.rollout.replica_weights import ReplicaWeights
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.hf import read_config
    from dockrl.parallel.dist import init_distributed, side_group

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    group = side_group("127.0.0.1", sync_port, rank, world, timeout_s=120)
    results: dict = {}
    if rank == 0:
        engine = TrainEngine(base, device="cpu", precision="fp32", optim=OptimConfig(), lora=SPEC)
        switch = RolloutSwitch(
            engine, rank=0, world=1, tp_infer=1, infer_group=None, bucket_bytes=None, dtype=torch.float32
        )
        engine.model.eval()
        for version in range(3):
            randomize_adapters(engine.model, seed=10 + version)
            results[f"sent/{version}"] = switch.broadcast_adapters(group)
            with torch.no_grad():
                results[f"logits/{version}"] = engine.model(IDS)
    else:
        weights = ReplicaWeights(
            read_config(base),
            base,
            dtype=torch.float32,
            device=torch.device("cpu"),
            bucket_bytes=None,
            lora=SPEC,
            lead=2,
        )
        results["bytes_per_version"] = weights.bytes_per_version
        for version in range(3):
            results[f"received/{version}"] = weights.receive(version, group)
        results["alive_before"] = weights.versions_alive()  # all three staged: none taken yet
        for version in range(3):
            weights.take(version, timeout_s=10)
            with torch.no_grad():
                results[f"logits/{version}"] = weights.model(IDS)
            weights.finish()
        results["alive_after"] = weights.versions_alive()
    torch.save(results, f"{out}.{rank}")
    leave(rank)


def _adapted(model: Transformer) -> Transformer:
    adapted = tiny_model()
    apply_lora(adapted, SPEC)
    return adapted


def test_tensor_parallel_adapters_equal_one_process(tmp_path):
    """tp=2: column-parallel bases split lora_B by rows (A replicated, its partial gradients summed), row-parallel
    bases split lora_A by columns (B replicated, summed): loss and every adapter gradient equal the unsplit model's
    up to fp32 reassociation (helpers.GRAD_ATOL_OF_SCALE: the tp partial sums add in another order); with the
    adapters off the split model is its base again (row-parallel all-reduce order: same bound)."""
    from dockrl.parallel.dist import free_port
    from dockrl.parallel.spawn import spawn_ranks
    from helpers import assert_grads_close

    out = tmp_path / "tp.pt"
    spawn_ranks(_tp_worker, 2, free_port(), str(out))
    results = torch.load(out, weights_only=False)
    for family in ("qwen2", "qwen3"):
        (ref_loss, ref_grads), (tp_loss, tp_grads) = results[family]
        assert len(ref_grads) == 4 * len(LINEAR_NAMES) and all("lora_" in name for name in ref_grads)
        assert abs(tp_loss - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss)), family
        assert_grads_close(tp_grads, ref_grads, msg=family)
        assert results[family + "/off"] < 1e-4, family


def test_lora_engine_layouts_equal_one_process(tmp_path):
    """The adapters of a LoRA engine under FSDP2 x tp, (dp, tp) in (2,1), (1,2), (2,2), take the gradients of
    dp=1 x tp=1 up to fp32 reassociation (helpers.GRAD_ATOL_OF_SCALE); the base takes none and is not in the
    optimizer; in bf16 the frozen base is held in bf16 and the adapters in fp32."""
    from test_tp_equivalence import write_model

    from dockrl.parallel.dist import free_port
    from dockrl.parallel.spawn import spawn_ranks
    from helpers import assert_grads_close

    model_dir = str(write_model(tmp_path / "model", "qwen2"))
    out = tmp_path / "engine.pt"
    spawn_ranks(_engine_worker, 4, free_port(), model_dir, str(out))
    results = torch.load(out, weights_only=False)
    ref_grads, frozen, dtypes, num_optimized = _engine_update(model_dir, list(range(8)), 1, None)
    assert num_optimized == len(ref_grads) == 4 * len(LINEAR_NAMES) and not frozen
    assert dtypes == {"torch.float32/frozen", "torch.float32/trainable"}
    for layout in LORA_LAYOUTS:
        grads, frozen, _, count = results[layout]
        assert count == num_optimized and not frozen, layout
        assert_grads_close(grads, ref_grads, msg=layout)
    _, frozen, dtypes, _ = results["bf16"]
    assert dtypes == {"torch.bfloat16/frozen", "torch.float32/trainable"} and not frozen


def test_switch_merges_adapters_into_the_inference_shards(tmp_path):
    from test_tp_equivalence import write_model

    from dockrl.parallel.dist import free_port
    from dockrl.parallel.spawn import spawn_ranks

    model_dir = write_model(tmp_path / "model", "qwen2")
    out = tmp_path / "switch.pt"
    spawn_ranks(_switch_worker, 4, free_port(), str(model_dir), str(out))
    for rank, results in enumerate(torch.load(out, weights_only=False)):
        for pair, r in results.items():
            assert r["excess"] <= 0.0 and r["bitwise"], (rank, pair, r)
            assert r["merged"] == 2 * 4, (rank, pair, r)  # 2 layers x 4 adapted weights were changed


def test_adapter_only_sync_sends_the_adapters_and_keeps_each_version(tmp_path):
    """Separate placement under LoRA: the trainer sends only the adapters (fp32, bytes proportional to the
    rank); a replica with the rollout two steps ahead stages every version it receives (up to k + 1 alive) and
    generates each step with the version the step names: logits equal to the trainer's bit for bit (the same
    base read from the same file, the same unmerged LoRA forward on the same inputs)."""
    from dockrl.engines.reshard.switch import full_model_buckets
    from dockrl.parallel.dist import free_port
    from dockrl.parallel.spawn import spawn_ranks

    model = tiny_model()
    save_model(model, model.args, tmp_path / "base")
    out = tmp_path / "sync.pt"
    spawn_ranks(_sync_worker, 2, free_port(), free_port(), str(tmp_path / "base"), str(out))
    sender, replica = (torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1))
    adapter_numel = sum(a.numel() for a in adapter_state(_adapted(model)).values())
    assert replica["bytes_per_version"] == 4 * adapter_numel
    for version in range(3):
        assert sender[f"sent/{version}"] == replica[f"received/{version}"] == 4 * adapter_numel
        assert torch.equal(replica[f"logits/{version}"], sender[f"logits/{version}"]), version
    assert not torch.equal(sender["logits/0"], sender["logits/1"])  # the versions differ
    assert replica["alive_before"] == 3 and replica["alive_after"] == 1
    with torch.device("meta"):
        full = sum(b.numel for b in full_model_buckets(Transformer(model.args), None, torch.float32)[0])
    assert full == sum(p.numel() for p in model.parameters())  # what a full-weight sync sends, fp32
