"""Shard-sized loading: every rank reads only its blocks, and together they are the checkpoint, bit for bit.

dp=3 gives uneven FSDP2 shards (64 rows -> 22, 22, 20) and empty ones (the value head's bias [1] -> 1, 0, 0).
"""

import torch

from dockrl.parallel.dist import free_port
from dockrl.parallel.layout import Placement
from dockrl.parallel.sharded_load import checkpoint_block, fsdp_rows
from dockrl.parallel.spawn import spawn_ranks


def test_blocks_compose_tensor_parallel_and_fsdp_rows():
    assert [fsdp_rows(64, r, 3) for r in range(3)] == [(0, 22), (22, 44), (44, 64)]
    assert [fsdp_rows(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]
    assert [fsdp_rows(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    # column-parallel q_proj [8, 4] at tp=2: rows 4..8 for tp rank 1, then FSDP rows 2..4 of those
    assert checkpoint_block((8, 4), Placement(0, 1, 2, None, 1, 2)) == (slice(6, 8), slice(0, 4))
    # row-parallel o_proj [8, 4] at tp=2: columns 2..4 for tp rank 1, FSDP rows 0..4 for dp rank 0
    assert checkpoint_block((8, 4), Placement(1, 1, 2, None, 0, 2)) == (slice(0, 4), slice(2, 4))
    # replicated norm: whole under tp, FSDP rows only
    assert checkpoint_block((6,), Placement(None, 1, 2, None, 1, 2)) == (slice(3, 6),)
    # experts [4, 6, 2] at ep=2 (edp=2): experts 2..4 for ep rank 1, then FSDP rows (experts) 3..4 for edp rank 1
    assert checkpoint_block((4, 6, 2), Placement(0, 1, 2, None, 1, 2)) == (
        slice(3, 4),
        slice(0, 6),
        slice(0, 2),
    )


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


# Elastic resume: a checkpoint saved under (dp=2, tp=1) loads under (dp=1, tp=2) and (dp=4, tp=1).
ELASTIC_LAYOUTS = [(2, 1), (1, 2), (4, 1)]  # the first is the saving layout (its resume is the reference)


def _whole_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment whole (collectives over the engine's ranks); the step counters."""
    from dockrl.parallel.layout import full_tensor

    out = {}
    for name, param in engine.model.named_parameters():
        out[f"model/{name}"] = full_tensor(param.data, engine.placement(name)).clone()
        for key, value in engine.optimizer.state[param].items():
            whole = value.shape == param.shape  # else the step counter (cloned: the next step moves it)
            out[f"optim/{name}/{key}"] = (
                full_tensor(value, engine.placement(name)) if whole else value
            ).clone()
    return out


def _elastic_worker(rank: int, world: int, port: int, model_dir: str, out: str, leave) -> None:
    from pathlib import Path

    from test_tp_equivalence import ALGO, NUM_ROWS, make_rows
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.checkpoint.sharded import load_engine, save_engine
    from dockrl.config import ActorConfig, loss_plan
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    optim = ActorConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=2, warmup_steps=1)
    checkpoint = Path(out).parent / "elastic"

    def engine(dp: int, tp: int, **kwargs) -> TrainEngine:
        # (rep, dp, tp): the replicas of a smaller layout compute (and save) the same blocks
        mesh = init_device_mesh("cpu", (world // (dp * tp), dp, tp), mesh_dim_names=("rep", "dp", "tp"))
        return TrainEngine(
            model_dir,
            device="cpu",
            precision="fp32",
            mesh=mesh["dp", "tp"],
            optim=optim,
            total_optimizer_steps=4,
            **kwargs,
        )

    def step(engine: TrainEngine) -> dict[str, float]:
        per_rank = NUM_ROWS // engine.dp_size
        idx = list(range(engine.dp_rank * per_rank, (engine.dp_rank + 1) * per_rank))
        rows = make_rows(engine.args.vocab_size)
        fields = ["advantages", "ref_logprobs", "old_logprobs"]
        args = dict(temperature=0.7, micro_batch_size=2, pad_token_id=0, world_size=engine.dp_size)
        return policy_update(engine, rows, idx, fields, loss_plan(ALGO), **args)

    saving = engine(*ELASTIC_LAYOUTS[0])
    step(saving)  # AdamW moments and a step counter to save
    save_engine(saving, checkpoint)
    results = {"saved": _whole_state(saving)}
    for dp, tp in ELASTIC_LAYOUTS:
        resumed = engine(dp, tp, load_weights=False)
        load_engine(resumed, checkpoint)
        results[(dp, tp)] = {"loaded": _whole_state(resumed), "metrics": step(resumed)}
    # A checkpoint of the format before elastic resume (keys `<name>@tp<rank>` under tp > 1, each the FSDP2
    # DTensor of the rank's tp slice) still loads in the layout that wrote it, and names the reason elsewhere.
    legacy_dir, old = Path(out).parent / "legacy", engine(1, 2)
    step(old)
    legacy = {}
    for name, param in old.model.named_parameters():
        legacy[f"model/{name}@tp{old.tp_rank}"] = param
        for key, value in old.optimizer.state[param].items():
            legacy[f"optim/{name}@tp{old.tp_rank}/{key}"] = value
    legacy["optim_groups"] = tuple(
        {k: v for k, v in g.items() if k != "params"} for g in old.optimizer.param_groups
    )
    legacy["scheduler"] = (old.scheduler.state_dict(),)
    import torch.distributed.checkpoint as dcp

    dcp.save(legacy, checkpoint_id=str(legacy_dir))
    results["legacy_saved"] = _whole_state(old)
    same_layout = engine(1, 2, load_weights=False)
    load_engine(same_layout, legacy_dir)
    results["legacy_loaded"] = _whole_state(same_layout)
    try:
        load_engine(engine(2, 1, load_weights=False), legacy_dir)
    except ValueError as error:
        results["legacy_elsewhere"] = str(error)
    if rank == 0:
        torch.save(results, out)
    leave(rank)


def test_a_checkpoint_resumes_under_another_dp_and_tp(tmp_path):
    """Saved under (dp=2, tp=1), loaded under (dp=1, tp=2) and (dp=4, tp=1): every parameter, AdamW moment and
    step counter equals the saved one bit for bit (DCP reads each rank's new block from the saved blocks that
    overlap it), and the next step's loss agrees with the same-layout resume within fp32 reassociation.

    The bound. Both layouts run the next step's forward on bitwise-equal weights and rows; they differ only in
    how fp32 reductions are split: tp=2 sums each row-parallel layer's (o_proj, down_proj) dot products and the
    vocab-parallel softmax's sums as two partial sums, and dp regroups the loss's sum over tokens into
    per-rank partial sums. Reassociating a sum of n fp32 terms moves it by at most (n - 1) u sum|terms|
    (u = 2^-24), and every other operation is the same rounding in both layouts. Per token, the log-prob term
    passes through K = 2 layers x 3 reassociated reductions (attention output, MLP output, and the residual
    stream's norm) + 2 in the head (logsumexp and the target's logit) = 8 reductions of at most n = 256 terms
    (the vocabulary); RMSNorm keeps the activations they sum O(1), so each term of the loss (log-probs, KL and
    entropy terms, at most log V + its value in size) moves by at most K n u (log V + |loss|), and the mean over
    tokens by no more (its own reassociation adds N u |loss| for N <= 64 tokens)."""
    import math

    from test_tp_equivalence import write_model

    model_dir = write_model(tmp_path / "qwen2", "qwen2")
    out = tmp_path / "elastic.pt"
    spawn_ranks(_elastic_worker, 4, free_port(), str(model_dir), str(out))
    results = torch.load(out, weights_only=False)
    saved = results["saved"]
    assert any(k.endswith("/exp_avg_sq") for k in saved) and any(k.endswith("/step") for k in saved)
    for layout in ELASTIC_LAYOUTS:
        loaded = results[layout]["loaded"]
        assert set(loaded) == set(saved), layout
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (layout, key)
    legacy = results["legacy_saved"]
    assert set(results["legacy_loaded"]) == set(legacy)
    assert all(torch.equal(results["legacy_loaded"][k], v) for k, v in legacy.items())
    assert "loads only in the layout that wrote it" in results["legacy_elsewhere"]
    same = results[ELASTIC_LAYOUTS[0]]["metrics"]
    u, vocab, tokens = 2.0**-24, 256, 64
    bound = 8 * vocab * u * (math.log(vocab) + abs(same["loss"])) + tokens * u * abs(same["loss"])
    for layout in ELASTIC_LAYOUTS[1:]:
        diff = abs(results[layout]["metrics"]["loss"] - same["loss"])
        assert diff <= bound, (layout, diff, bound)
