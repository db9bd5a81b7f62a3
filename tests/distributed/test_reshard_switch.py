"""Allgather-swap between training (dp, tp_train) and inference (replicas, tp_infer) layouts.

One spawn of 4 gloo processes runs every (tp_train, tp_infer) pair in {1, 2, 4}^2: after one update,
enter() the inference layout (with offload forced to really free and restore storage on CPU), sample a
sequence per replica, exit(); then training state must be bitwise unchanged, the trainer's log-probs of
every sampled sequence must equal the rollout log-probs, and the naive full-state-dict switch must build
the same inference weights.
"""

import pytest
import torch
from test_tp_equivalence import ALGO, NUM_ROWS, make_rows, write_model

from dockrl.config import ActorConfig, loss_plan
from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks

PAIRS = [(t, i) for t in (1, 2, 4) for i in (1, 2, 4)]
TEMPERATURE = 0.9


def _snapshot(engine) -> dict[str, torch.Tensor]:
    from dockrl.engines.reshard.offload import local_tensor

    out = {f"param:{n}": local_tensor(p).clone() for n, p in engine.model.named_parameters()}
    for i, state in enumerate(engine.optimizer.state.values()):
        for k, v in state.items():
            out[f"optim:{i}:{k}"] = local_tensor(v).clone()
    return out


def _run_pair(rank: int, world: int, model_dir: str, tp_train: int, tp_infer: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.engines.reshard.switch import RolloutSwitch
    from dockrl.engines.rollout.sampler import SamplingParams, generate
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine

    dp = world // tp_train
    train_mesh = init_device_mesh("cpu", (dp, tp_train), mesh_dim_names=("dp", "tp"))
    optim = ActorConfig(lr=1e-2, micro_batch_size=4)
    engine = TrainEngine(model_dir, device="cpu", precision="fp32", mesh=train_mesh, optim=optim)
    per_rank = NUM_ROWS // dp
    idx = list(range(engine.dp_rank * per_rank, (engine.dp_rank + 1) * per_rank))
    batch = make_rows(engine.args.vocab_size)
    policy_update(
        engine,
        batch,
        idx,
        ["advantages", "ref_logprobs", "old_logprobs"],
        loss_plan(ALGO),
        temperature=TEMPERATURE,
        micro_batch_size=4,
        pad_token_id=0,
        world_size=dp,
    )
    before = _snapshot(engine)
    infer_mesh = init_device_mesh("cpu", (world // tp_infer, tp_infer), mesh_dim_names=("replica", "tp"))
    largest = engine.args.vocab_size * engine.args.hidden_size * 4 * (1 + (tp_train > 1) / tp_train)
    switch = RolloutSwitch(
        engine,
        rank=rank,
        world=world,
        tp_infer=tp_infer,
        infer_group=infer_mesh.get_group("tp"),
        bucket_bytes=int(largest),
        dtype=torch.float32,
        host_copy=True,
    )
    switch.enter()
    freed = all(p.to_local().untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    replica = rank // tp_infer
    prompt = [[2 + replica, 7, 11 + 3 * replica, 5]]
    params = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE)
    out = generate(switch.model, prompt, params, [1234 + replica], pad_token_id=0)[0]
    bucketed = {n: p.clone() for n, p in switch.model.named_parameters()}
    switch.exit()
    after_first = _snapshot(engine)
    switch.enter(naive=True)
    naive_equal = all(torch.equal(bucketed[n], p) for n, p in switch.model.named_parameters())
    switch.exit()
    switch.enter(baseline="streaming")  # the benchmark's other baseline builds the same inference weights
    naive_equal &= all(torch.equal(bucketed[n], p) for n, p in switch.model.named_parameters())
    switch.exit()
    after = _snapshot(engine)
    bitwise = all(torch.equal(before[k], after[k]) and torch.equal(before[k], after_first[k]) for k in before)
    # The trainer scores every replica's sequence (tp peers of the training layout need the same inputs).
    sequences = [None] * world
    torch.distributed.all_gather_object(sequences, (prompt[0], out.token_ids, out.logprobs))
    prompts = [torch.tensor(s[0]) for s in sequences]
    logps, _ = engine.logprobs(
        prompts, [s[1] for s in sequences], temperature=TEMPERATURE, micro_batch_size=8, pad_token_id=0
    )
    error = max(float((lp - s[2]).abs().max()) for lp, s in zip(logps, sequences))
    return {
        "bitwise": bitwise,
        "freed": freed,
        "naive_equal": naive_equal,
        "logprob_error": error,
        "num_buckets": len(switch.buckets),
        "tokens": len(out.token_ids),
    }


def _worker(rank: int, world: int, port: int, model_dir: str, out_path: str, leave) -> None:
    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {pair: _run_pair(rank, world, model_dir, *pair) for pair in PAIRS}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)
    leave(rank)


def test_switch_round_trip_and_rollout_trainer_parity(tmp_path):
    model_dir = write_model(tmp_path / "qwen3", "qwen3", seed=3)
    out = tmp_path / "results.pt"
    spawn_ranks(_worker, 4, free_port(), str(model_dir), str(out))
    for rank, results in enumerate(torch.load(out, weights_only=False)):
        for pair, r in results.items():
            assert r["bitwise"] and r["freed"] and r["naive_equal"], (rank, pair, r)
            assert r["logprob_error"] < 1e-5, (rank, pair, r)
            assert r["tokens"] >= 1
            assert r["num_buckets"] > 1 or pair[1] > 1, "whole-model shards span several buckets"


def test_bucket_smaller_than_largest_tensor_is_an_error(tiny_model):
    from dockrl.engines.reshard.switch import RolloutSwitch
    from dockrl.engines.train.train_engine import TrainEngine

    engine = TrainEngine(str(tiny_model), device="cpu", precision="fp32", optim=ActorConfig())
    with pytest.raises(
        ValueError, match=r"reshard.bucket_mb=.*embed_tokens.*use reshard.bucket_mb >= 1 or None"
    ):
        RolloutSwitch(
            engine, rank=0, world=1, tp_infer=1, infer_group=None, bucket_bytes=1024, dtype=torch.float32
        )


def test_single_process_switch_frees_and_restores(tiny_model):
    from dockrl.engines.reshard.switch import RolloutSwitch
    from dockrl.engines.train.train_engine import TrainEngine

    engine = TrainEngine(str(tiny_model), device="cpu", precision="fp32", optim=ActorConfig())
    for param in engine.model.parameters():  # own resizable storage (not the safetensors mapping)
        param.data = param.data.clone()
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    switch = RolloutSwitch(
        engine,
        rank=0,
        world=1,
        tp_infer=1,
        infer_group=None,
        bucket_bytes=2**20,
        dtype=torch.float32,
        host_copy=True,
    )
    switch.enter()
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    for name, param in switch.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert switch.inference_shard_bytes == sum(t.numel() * 4 for t in before.values())
    switch.exit()
    for name, param in engine.model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
