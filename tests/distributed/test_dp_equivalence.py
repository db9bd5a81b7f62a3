"""dp=2 (two gloo processes, FSDP2) and dp=1 take the same policy update on the same rows."""

import pytest
import torch

from dockrl.config import ActorConfig, AlgoConfig, loss_plan
from dockrl.config.schema import FSDP_UNIT_PARAMS
from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks
from helpers import assert_grads_close, fsdp_unit_count, full_grads

NUM_ROWS = 8
ALGO = AlgoConfig(kl_coef=0.05, clip_low=0.2, clip_high=0.28)
OPTIM = ActorConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=2)


def make_rows(vocab: int) -> dict[str, list]:
    """Ragged rows with uneven prompt/response lengths and per-token columns."""
    g = torch.Generator().manual_seed(0)
    batch = {k: [] for k in ("prompt_ids", "response_ids", "advantages", "ref_logprobs", "old_logprobs")}
    for i in range(NUM_ROWS):
        p, r = 3 + i % 4, 2 + (i * 3) % 7
        batch["prompt_ids"].append(torch.randint(0, vocab, (p,), generator=g))
        batch["response_ids"].append(torch.randint(0, vocab, (r,), generator=g))
        batch["advantages"].append(torch.full((r,), float(torch.randn(1, generator=g))))
        batch["ref_logprobs"].append(-torch.rand(r, generator=g) * 5)
        batch["old_logprobs"].append(-torch.rand(r, generator=g) * 5)
    return batch


def run_update(
    model_dir: str,
    idx: list[int],
    world_size: int,
    mesh=None,
    micro_batch_size: int = 2,
    max_tokens: int = 0,
    precision: str = "fp32",
    unit_params: int = FSDP_UNIT_PARAMS,
    units: list[int] | None = None,
):
    """`units`, when given, gets the number of FSDP2 units the engine built."""
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine

    optim = ActorConfig(lr=OPTIM.lr, grad_clip=OPTIM.grad_clip, micro_batch_size=micro_batch_size)
    engine = TrainEngine(
        model_dir, device="cpu", precision=precision, mesh=mesh, optim=optim, fsdp_unit_params=unit_params
    )
    if units is not None:
        units.append(fsdp_unit_count(engine.model))
    batch = make_rows(engine.args.vocab_size)
    metrics = policy_update(
        engine,
        batch,
        idx,
        ["advantages", "ref_logprobs", "old_logprobs"],
        loss_plan(ALGO),
        temperature=1.0,
        micro_batch_size=micro_batch_size,
        max_tokens_per_micro_batch=max_tokens,
        pad_token_id=0,
        world_size=world_size,
    )
    return metrics, full_grads(engine), engine.full_state_dict()


def _dp_worker(
    rank: int,
    world_size: int,
    port: int,
    model_dir: str,
    out_path: str,
    precision: str,
    unit_params: int,
    leave,
) -> None:
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=120)
    mesh = data_parallel_mesh("cpu", world_size)
    per_rank = NUM_ROWS // world_size
    # A token budget of 24 (rows of 5 to 14 tokens): micro-batches of 1 to 4 rows sorted by length, and the two
    # ranks end up with different counts (the one with fewer runs idle micro-batches to keep FSDP2 in step).
    rows = list(range(rank * per_rank, (rank + 1) * per_rank))
    units: list[int] = []
    metrics, grads, _ = run_update(
        model_dir,
        rows,
        world_size,
        mesh,
        max_tokens=24,
        precision=precision,
        unit_params=unit_params,
        units=units,
    )
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "units": units[0]}, out_path)
    leave(rank)


def test_token_budget_micro_batches_group_like_lengths():
    from dockrl.engines.train.batch import micro_batch_rows

    lengths = [5, 100, 30, 30, 7]
    # Longest first; a micro-batch closes when one more row would pad past the budget; 100 > 64 goes alone.
    assert micro_batch_rows(lengths, micro_batch_size=2, max_tokens=64) == [[1], [2, 3], [4, 0]]
    assert micro_batch_rows(lengths, micro_batch_size=2, max_tokens=0) == [[0, 1], [2, 3], [4]]
    assert micro_batch_rows(lengths, micro_batch_size=2, max_tokens=10_000) == [[1, 2, 3, 4, 0]]


@pytest.mark.parametrize("unit_params", [0, FSDP_UNIT_PARAMS], ids=["unit-per-layer", "grouped"])
def test_dp2_equals_dp1(tmp_path, tiny_model, unit_params):
    """The same update whichever FSDP2 units shard the model (actor.fsdp_unit_params): a unit per layer, or the
    tiny model's ~50k parameters as one unit at the root."""
    ref_metrics, ref_grads, _ = run_update(str(tiny_model), list(range(NUM_ROWS)), world_size=1)
    out = tmp_path / "dp2.pt"
    spawn_ranks(_dp_worker, 2, free_port(), str(tiny_model), str(out), "fp32", unit_params)
    dp2 = torch.load(out)
    from dockrl.models.hf import read_config

    # the units asked for were built: each layer and the root, or the root alone
    assert dp2["units"] == (read_config(tiny_model).num_layers + 1 if unit_params == 0 else 1)
    for key in ("loss", "pg_loss", "kl", "grad_norm", "clip_frac"):
        # O(1) sums of a few hundred fp32 terms: rounding stays near 1e-5 relative (see helpers.GRAD_RTOL).
        assert dp2["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
    assert ref_metrics["grad_norm"] > 0
    assert_grads_close(dp2["grads"], ref_grads)


# bf16 (FSDP2 casts the weights to bf16; gradients and their reduction in fp32): dp=1 and dp=2 run every row
# through the same bf16 ops, but the gradient of a weight is a matmul over a micro-batch's tokens whose result is
# rounded to bf16 (unit roundoff u = 2^-9) before the fp32 sum over micro-batches and ranks, and the two layouts
# group the rows differently. Each of the at most 8 partial sums of an element carries one rounding of at most
# u x its size, so an element moves by at most 8u x the tensor's scale, its largest |element|.
BF16_GRAD_ATOL_OF_SCALE = 8 * 2.0**-9


def test_dp2_equals_dp1_in_bf16(tmp_path, tiny_model):
    outs = {}
    for world in (1, 2):
        outs[world] = tmp_path / f"dp{world}.pt"
        spawn_ranks(
            _dp_worker, world, free_port(), str(tiny_model), str(outs[world]), "bf16", FSDP_UNIT_PARAMS
        )
    dp1, dp2 = torch.load(outs[1]), torch.load(outs[2])
    assert dp1["metrics"]["grad_norm"] > 0
    for key in ("loss", "pg_loss", "kl"):  # sums of fp32 per-token terms of the same bf16 log-probs
        assert dp2["metrics"][key] == pytest.approx(dp1["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, ref in dp1["grads"].items():
        scale = float(ref.abs().max())
        assert scale > 0, name
        diff = float((dp2["grads"][name] - ref).abs().max())
        assert diff <= BF16_GRAD_ATOL_OF_SCALE * scale, (name, diff / scale)


def test_update_changes_parameters_and_is_micro_batch_invariant(tiny_model):
    from dockrl.models.hf import load_state_dict

    initial = load_state_dict(tiny_model)
    m8, g8, s8 = run_update(str(tiny_model), list(range(NUM_ROWS)), world_size=1, micro_batch_size=8)
    m1, g1, _ = run_update(str(tiny_model), list(range(NUM_ROWS)), world_size=1, micro_batch_size=1)
    assert m1["loss"] == pytest.approx(m8["loss"], rel=1e-4, abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-4)
    moved = [n for n in s8 if not torch.equal(s8[n], initial[n])]
    assert len(moved) == len(s8), "every parameter receives a gradient and moves"
    # One micro-batch of 8 and eight of 1 accumulate the same gradient (compared before Adam, see helpers).
    assert_grads_close(g1, g8)


def test_rows_of_weight_zero_leave_no_trace_in_the_update(tiny_model):
    """reward.on_error=drop_group: a row of update_weight 0 changes neither the loss nor the gradient."""
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine

    def grads(idx: list[int], weights: list[float] | None):
        engine = TrainEngine(str(tiny_model), device="cpu", precision="fp32", optim=OPTIM)
        batch = make_rows(engine.args.vocab_size)
        if weights is not None:
            batch["update_weight"] = weights
        names = ["advantages", "ref_logprobs", "old_logprobs"]
        args = dict(temperature=1.0, micro_batch_size=2, pad_token_id=0, world_size=1)
        return policy_update(engine, batch, idx, names, loss_plan(ALGO), **args), full_grads(engine)

    weights = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    m_dropped, g_dropped = grads(list(range(NUM_ROWS)), weights)
    m_without, g_without = grads([i for i in range(NUM_ROWS) if weights[i]], None)
    for key in ("loss", "pg_loss", "kl", "clip_frac"):
        assert m_dropped[key] == pytest.approx(m_without[key], rel=1e-4, abs=1e-6), key
    assert_grads_close(g_dropped, g_without)


def _logprob_worker(rank: int, world_size: int, port: int, model_dir: str, out_path: str, leave) -> None:
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=120)
    mesh = data_parallel_mesh("cpu", world_size)
    engine = TrainEngine(model_dir, device="cpu", precision="fp32", mesh=mesh, trainable=False)
    batch = make_rows(engine.args.vocab_size)
    rows = [0] if rank == 0 else list(range(1, NUM_ROWS))  # 1 micro-batch against 7
    logps, _ = engine.logprobs(
        [batch["prompt_ids"][i] for i in rows],
        [batch["response_ids"][i] for i in rows],
        temperature=1.0,
        micro_batch_size=1,
        pad_token_id=0,
    )
    torch.save(dict(zip(rows, logps)), f"{out_path}.{rank}")
    leave(rank)


def test_ranks_with_uneven_rows_compute_logprobs_in_step(tmp_path, tiny_model):
    # compute_ref / compute_old with a rank that holds fewer rows: it runs idle forwards until its peer is done
    # (regression: the count was agreed after the rank's own forwards, so it waited in an all-reduce while its
    # peer waited in FSDP2's all-gather, and the step hung).
    from dockrl.engines.train.train_engine import TrainEngine

    out = tmp_path / "logps"
    spawn_ranks(_logprob_worker, 2, free_port(), str(tiny_model), str(out))
    got = torch.load(f"{out}.0") | torch.load(f"{out}.1")
    engine = TrainEngine(str(tiny_model), device="cpu", precision="fp32", trainable=False)
    batch = make_rows(engine.args.vocab_size)
    ref, _ = engine.logprobs(
        batch["prompt_ids"], batch["response_ids"], temperature=1.0, micro_batch_size=1, pad_token_id=0
    )
    # The same fp32 forward of one row on the same weights (FSDP2 gathers them exactly); only the thread count
    # differs, which can reorder the 128- and 384-term dot products: ~1e-6 relative on log-probs of size ~6.
    for i in range(NUM_ROWS):
        torch.testing.assert_close(got[i], ref[i], rtol=0, atol=1e-4)


def _single_micro_batch_worker(
    rank: int, world_size: int, port: int, model_dir: str, out_path: str, keep: bool, leave
) -> None:
    """One micro-batch per rank (4 rows, no token budget); `keep` False turns the kept-unsharded path off."""
    import contextlib

    import torch.distributed as dist

    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=120)
    if not keep:
        TrainEngine._kept_unsharded = lambda self, single: contextlib.nullcontext()  # type: ignore[method-assign]
    gathers, all_gather = [0], dist.all_gather_single

    def counted(*args, **kwargs):
        gathers[0] += 1
        return all_gather(*args, **kwargs)

    dist.all_gather_single = counted
    mesh = data_parallel_mesh("cpu", world_size)
    rows = list(range(rank * 4, rank * 4 + 4))
    # a unit per layer: the gathers counted below are the layers'
    metrics, grads, state = run_update(model_dir, rows, world_size, mesh, micro_batch_size=4, unit_params=0)
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "state": state, "gathers": gathers[0]}, out_path)
    leave(rank)


def test_one_micro_batch_gathers_each_layer_once_with_the_same_numbers(tmp_path, tiny_model):
    """A step of one micro-batch keeps each layer's gathered weights from forward to backward: fewer FSDP2
    all-gathers, and bit for bit the gradients, metrics and updated weights of gathering them twice."""
    got = {}
    for keep in (True, False):
        out = tmp_path / f"keep{keep}.pt"
        spawn_ranks(_single_micro_batch_worker, 2, free_port(), str(tiny_model), str(out), keep)
        got[keep] = torch.load(out)
    kept, regathered = got[True], got[False]
    assert kept["metrics"]["grad_norm"] > 0
    assert kept["metrics"] == regathered["metrics"]
    for part in ("grads", "state"):
        for name, value in regathered[part].items():
            assert torch.equal(kept[part][name], value), (part, name)
    from dockrl.models.hf import read_config

    layers = read_config(tiny_model).num_layers
    # the layers' backward re-gathers are gone (the full state dict's own gathers are the same in both)
    assert regathered["gathers"] - kept["gathers"] == layers
