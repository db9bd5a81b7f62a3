"""Shard-sized loading: every rank reads only its blocks, and together they are the checkpoint, bit for bit.

dp=3 gives uneven FSDP2 shards (64 rows -> 22, 22, 20) and empty ones (the value head's bias [1] -> 1, 0, 0).
"""

import torch
import torch.multiprocessing as mp

from dockrl.parallel.dist import free_port
from dockrl.parallel.load import checkpoint_block, fsdp_rows


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


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    from dockrl.config import ActorConfig, CriticConfig
    from dockrl.models.value import value_model_kind
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed
    from dockrl.workers.train.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    mesh = data_parallel_mesh("cpu", world)
    policy = TrainEngine(model_dir, device="cpu", precision="fp32", mesh=mesh, optim=ActorConfig())
    local_numel = sum(p.to_local().numel() for p in policy.model.parameters())
    critic = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=mesh, optim=CriticConfig(), kind=value_model_kind(5)
    )
    states = {"policy": policy.full_state_dict(), "critic": critic.full_state_dict()}
    numels = [None] * world
    torch.distributed.all_gather_object(numels, local_numel)
    if rank == 0:
        torch.save({**states, "numels": numels}, out)
    torch.distributed.destroy_process_group()


def test_dp3_shards_reassemble_the_checkpoint_bitwise(tmp_path, tiny_model):
    from dockrl.models.hf import load_state_dict
    from dockrl.models.value import load_value_model

    out = tmp_path / "states.pt"
    mp.start_processes(
        _worker, args=(3, free_port(), str(tiny_model), str(out)), nprocs=3, start_method="spawn"
    )
    result = torch.load(out)
    expected = load_state_dict(tiny_model)
    assert set(result["policy"]) == set(expected) - {"lm_head.weight"} or set(result["policy"]) == set(
        expected
    )
    for name, tensor in result["policy"].items():
        assert torch.equal(tensor, expected[name].float()), name
    critic = load_value_model(tiny_model, seed=5).state_dict()
    assert set(result["critic"]) == set(critic)
    for name, tensor in result["critic"].items():
        assert torch.equal(tensor, critic[name]), name
    # each rank holds its FSDP rows of every tensor (ceil(rows / 3) at most), about a third of the model
    total = sum(t.numel() for t in result["policy"].values())
    largest_share = sum(-(-t.shape[0] // 3) * t[0].numel() for t in result["policy"].values())
    assert sum(result["numels"]) == total and max(result["numels"]) == largest_share < 0.34 * total
