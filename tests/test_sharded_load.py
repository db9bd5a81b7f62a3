"""Shard-sized loading: every rank reads only its blocks, and together they are the checkpoint, bit for bit.

dp=3 gives uneven FSDP2 shards (64 rows -> 22, 22, 20) and empty ones (the value head's bias [1] -> 1, 0, 0).
"""

import torch

from dockrl.parallel.dist import free_port
from dockrl.parallel.sharded_load import checkpoint_block, fsdp_rows
from dockrl.parallel.spawn import spawn_ranks


def test_blocks_compose_tensor_parallel_and_fsdp_rows():
    assert [fsdp_rows(64, r, 3) for r in range(3)] == [(0, 22), (22, 44), (44, 64)]
    assert [fsdp_rows(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]
    assert [fsdp_rows(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    # column-parallel q_proj [8, 4] at tp=2: rows 4..8 for tp rank 1, then FSDP rows 2..4 of those
    block = checkpoint_block(
        "model.layers.0.self_attn.q_proj.weight", (8, 4), tp_rank=1, tp=2, dp_rank=1, dp=2
    )
    assert block == (slice(6, 8), slice(0, 4))
    # row-parallel o_proj [8, 4] at tp=2: columns 2..4 for tp rank 1, FSDP rows 0..4 for dp rank 0
    block = checkpoint_block(
        "model.layers.0.self_attn.o_proj.weight", (8, 4), tp_rank=1, tp=2, dp_rank=0, dp=2
    )
    assert block == (slice(0, 4), slice(2, 4))
    # replicated norm: whole under tp, FSDP rows only
    assert checkpoint_block("model.norm.weight", (6,), tp_rank=1, tp=2, dp_rank=1, dp=2) == (slice(3, 6),)


def _step(engine, world: int) -> dict:
    from dockrl.config import AlgoConfig, loss_plan
    from dockrl.engines.train.policy_update import policy_update

    g = torch.Generator().manual_seed(engine.dp_rank)
    batch = {
        "prompt_ids": [torch.randint(0, 100, (5,), generator=g) for _ in range(2)],
        "response_ids": [torch.randint(0, 100, (4,), generator=g) for _ in range(2)],
        "advantages": [torch.full((4,), 1.0), torch.full((4,), -1.0)],
    }
    algo = AlgoConfig(kl_coef=0.0)
    args = dict(temperature=1.0, micro_batch_size=2, pad_token_id=0, world_size=world)
    return policy_update(engine, batch, [0, 1], ["advantages"], loss_plan(algo), **args)


def _worker(rank: int, world: int, port: int, model_dir: str, out: str, leave) -> None:
    from pathlib import Path

    from dockrl.checkpoint.sharded import export_hf, load_engine, save_engine
    from dockrl.config import ActorConfig, CriticConfig
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.value import value_model_kind
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    mesh = data_parallel_mesh("cpu", world)
    optim = ActorConfig(lr=1e-3, warmup_steps=2)
    policy = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=mesh, optim=optim, total_optimizer_steps=5
    )
    local_numel = sum(p.to_local().numel() for p in policy.model.parameters())
    critic = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=mesh, optim=CriticConfig(), kind=value_model_kind(5)
    )
    states = {"policy": policy.full_state_dict(), "critic": critic.full_state_dict()}
    # Uneven and empty shards through a checkpoint: one step, save, a fresh engine loads it, one more step each.
    _step(policy, world)
    checkpoint = Path(out).parent / "checkpoint"
    save_engine(policy, checkpoint / "actor")
    export_hf(policy, checkpoint / "hf", tokenizer_dir=model_dir)
    states["exported_from"] = policy.full_state_dict()
    fresh = TrainEngine(
        model_dir,
        device="cpu",
        precision="fp32",
        mesh=mesh,
        optim=optim,
        total_optimizer_steps=5,
        load_weights=False,
    )
    load_engine(fresh, checkpoint / "actor")
    metrics = [_step(policy, world), _step(fresh, world)]
    states["continued"], states["resumed"] = policy.full_state_dict(), fresh.full_state_dict()
    numels = [None] * world
    torch.distributed.all_gather_object(numels, local_numel)
    if rank == 0:
        torch.save({**states, "numels": numels, "metrics": metrics}, out)
    leave(rank)


def test_dp3_shards_reassemble_the_checkpoint_bitwise(tmp_path, tiny_model):
    from dockrl.models.hf import load_state_dict, read_config, save_model
    from dockrl.models.value import load_value_model

    # a bf16 source checkpoint: trained in fp32 master weights, exported in bf16 again
    source = tmp_path / "bf16"
    state = load_state_dict(tiny_model)
    save_model(state, read_config(tiny_model), source, tokenizer_dir=tiny_model, dtype=torch.bfloat16)
    out = tmp_path / "states.pt"
    spawn_ranks(_worker, 3, free_port(), str(source), str(out))
    result = torch.load(out)
    expected = load_state_dict(source)
    assert set(result["policy"]) == set(expected)
    for name, tensor in result["policy"].items():
        assert torch.equal(tensor, expected[name].float()), name
    critic = load_value_model(source, seed=5).state_dict()
    assert set(result["critic"]) == set(critic)
    for name, tensor in result["critic"].items():
        assert torch.equal(tensor, critic[name]), name
    # each rank holds its FSDP rows of every tensor (ceil(rows / 3) at most), about a third of the model
    total = sum(t.numel() for t in result["policy"].values())
    largest_share = sum(-(-t.shape[0] // 3) * t[0].numel() for t in result["policy"].values())
    assert sum(result["numels"]) == total and max(result["numels"]) == largest_share < 0.34 * total

    # the checkpoint resumes exactly: the next step of the saved engine and of the loaded one agree bitwise
    continued, resumed = result["continued"], result["resumed"]
    assert result["metrics"][0] == result["metrics"][1]
    assert all(torch.equal(continued[k], resumed[k]) for k in continued)
    assert not all(torch.equal(continued[k], result["exported_from"][k]) for k in continued)  # it moved
    # the Hugging Face export is gathered from the shards and keeps the source dtype
    exported = load_state_dict(tmp_path / "checkpoint" / "hf")
    assert set(exported) == set(expected) and all(t.dtype == torch.bfloat16 for t in exported.values())
    for name, tensor in exported.items():
        assert torch.equal(tensor, result["exported_from"][name].to(torch.bfloat16)), name
