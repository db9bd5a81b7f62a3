"""Context parallelism (actor.cp): one policy update with cp = 2 and 4 (alone, with dp = 2, with tp = 2, with LoRA)
equals the single process's loss, metrics and gradients; a checkpoint saved under cp = 4 resumes under cp = 2, 1
and (dp, tp) = (2, 2) bit for bit.

One spawn of 4 gloo processes runs every case in sequence on its own (rep, dp, cp, tp) sub-mesh, as the tensor-
parallel test does. Rows are 15 to 45 tokens long, so at cp = 4 every sequence spans all 8 zig-zag chunks (2 to 6
tokens each), and every chunk pair of the ring (whole, diagonal, skipped) occurs.

Bounds: the split changes only the order of fp32 sums. Attention's softmax is summed per key block and the blocks
merged by log-sum-exp (a few extra roundings of eps_fp32 = 1.2e-7 per query, relative); the gradients of keys and
values add cp partial sums (one per ring step) instead of one; FSDP2 averages over dp x cp ranks instead of dp;
the loss's per-token terms are the same numbers summed in another order. Each gradient element is a sum of at most
~10^3 products here (tokens x heads x ranks), so it moves by < 1e3 x eps_fp32 ~ 1.2e-4 of its tensor's scale:
helpers.GRAD_RTOL / GRAD_ATOL_OF_SCALE, and 1e-4 relative on the O(1) loss sums (the tp test's bound, same
argument). Wrong rotary offsets, a skipped online-softmax merge, a chunk attending the wrong blocks or a missing
1/cp change the loss and gradients by O(1) of their scale.
"""

from pathlib import Path

import pytest
import torch

from dockrl.config import ActorConfig, AlgoConfig, loss_plan
from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks
from helpers import assert_grads_close

NUM_ROWS = 8
ALGO = AlgoConfig(kl_coef=0.05, clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2)]  # (dp, cp, tp)
LORA_LAYOUTS = [(1, 2, 1), (2, 2, 1)]
# A checkpoint saved under (dp, cp, tp) = (1, 4, 1) resumes under these (FSDP2 shards over dp x cp: 4, 2, 1 x tp 2).
ELASTIC_LAYOUTS = [(1, 2, 1), (2, 1, 2), (1, 1, 1)]
METRICS = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac")


def write_model(path) -> str:
    """A tiny qwen2 model (grouped queries: 4 heads over 2 key/value heads) with weights ~ N(0, 0.15): attention
    then depends strongly on positions and keys (at N(0, 0.02) it is nearly uniform, and a wrong rotary offset
    would move the gradients by only ~1e-3 of their scale)."""
    from dockrl.models.config import ModelArgs
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import save_model

    args = ModelArgs(
        family="qwen2",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=True,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = Transformer(args)
    model.init_weights(seed=0, std=0.15)
    save_model(model, args, path)
    return str(path)


def make_rows(vocab: int) -> dict[str, list]:
    """Ragged rows (prompts 5-12 tokens, responses 10-33) with per-token columns."""
    g = torch.Generator().manual_seed(0)
    batch = {k: [] for k in ("prompt_ids", "response_ids", "advantages", "ref_logprobs", "old_logprobs")}
    for i in range(NUM_ROWS):
        p, r = 5 + (i * 5) % 8, 10 + (i * 7) % 24
        batch["prompt_ids"].append(torch.randint(0, vocab, (p,), generator=g))
        batch["response_ids"].append(torch.randint(0, vocab, (r,), generator=g))
        batch["advantages"].append(torch.full((r,), float(torch.randn(1, generator=g))))
        batch["ref_logprobs"].append(-torch.rand(r, generator=g) * 5)
        batch["old_logprobs"].append(-torch.rand(r, generator=g) * 5)
    return batch


def grads(engine) -> dict[str, torch.Tensor]:
    """The whole gradient of every trained parameter (a collective under FSDP2 / tp)."""
    from dockrl.parallel.layout import full_tensor

    return {
        name: full_tensor(param.grad, engine.placement(name)).detach().clone()
        for name, param in engine.model.named_parameters()
        if param.requires_grad
    }


def run_update(
    model_dir: str, idx: list[int], dp: int, mesh=None, lora: bool = False, keep: list | None = None
):
    """One policy update on rows idx; returns (metrics, gradients before the optimizer step); the engine is
    appended to `keep` when given."""
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.lora import LoraSpec

    optim = ActorConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=2)
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))
    engine = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=mesh, optim=optim, lora=spec if lora else None
    )
    if lora:  # fresh adapters have B = 0: give them values so every adapter gets a gradient
        with torch.no_grad():
            for name, param in engine.model.named_parameters():
                if name.endswith("lora_B"):
                    param.fill_(0.05)
    metrics = policy_update(
        engine,
        make_rows(engine.args.vocab_size),
        idx,
        ["advantages", "ref_logprobs", "old_logprobs"],
        loss_plan(ALGO),
        temperature=0.7,
        micro_batch_size=2,
        pad_token_id=0,
        world_size=dp,
    )
    if keep is not None:
        keep.append(engine)
    return metrics, grads(engine)


def _mesh(world: int, dp: int, cp: int, tp: int):
    """The (dp, cp, tp) sub-mesh of a (rep, dp, cp, tp) mesh over all ranks (replicas compute the same)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", (world // (dp * cp * tp), dp, cp, tp), mesh_dim_names=("rep", "dp", "cp", "tp")
    )
    return mesh["dp", "cp", "tp"]


def _elastic(world: int, model_dir: str, saving, checkpoint: str) -> dict:
    """Save `saving` (trained one step under (dp, cp) = (1, 4)) and load it under each of ELASTIC_LAYOUTS: every
    parameter, AdamW moment and step counter whole, as saved and as loaded."""
    from test_sharded_load import _whole_state

    from dockrl.checkpoint.sharded import load_engine, save_engine
    from dockrl.engines.train.train_engine import TrainEngine

    save_engine(saving, checkpoint)
    out = {"saved": _whole_state(saving)}
    for dp, cp, tp in ELASTIC_LAYOUTS:
        optim = ActorConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=2)
        mesh = _mesh(world, dp, cp, tp)
        resumed = TrainEngine(
            model_dir, device="cpu", precision="fp32", mesh=mesh, optim=optim, load_weights=False
        )
        load_engine(resumed, checkpoint)
        out[(dp, cp, tp)] = _whole_state(resumed)
    return out


def _worker(rank: int, world: int, port: int, model_dir: str, out_path: str, leave) -> None:
    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {}
    cases = [(layout, False) for layout in LAYOUTS] + [(layout, True) for layout in LORA_LAYOUTS]
    engines: list = []
    for (dp, cp, tp), lora in cases:
        mesh = _mesh(world, dp, cp, tp)
        per_rank = NUM_ROWS // dp
        dp_rank = mesh["dp"].get_local_rank()
        idx = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        keep = engines if (dp, cp, tp, lora) == (1, 4, 1, False) else None
        results[(dp, cp, tp, lora)] = run_update(model_dir, idx, dp, mesh, lora, keep)
    results["elastic"] = _elastic(world, model_dir, engines[0], str(Path(out_path).parent / "checkpoint"))
    if rank == 0:
        torch.save(results, out_path)
    leave(rank)


def test_cp_layouts_equal_single_process(tmp_path):
    model_dir = write_model(tmp_path / "model")
    out = tmp_path / "results.pt"
    spawn_ranks(_worker, 4, free_port(), model_dir, str(out))
    results = torch.load(out, weights_only=False)
    for lora in (False, True):
        ref_metrics, ref_grads = run_update(model_dir, list(range(NUM_ROWS)), dp=1, lora=lora)
        assert ref_metrics["grad_norm"] > 0 and ref_metrics["entropy"] > 0
        for dp, cp, tp in LORA_LAYOUTS if lora else LAYOUTS:
            metrics, cp_grads = results[(dp, cp, tp, lora)]
            for key in METRICS:
                assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (
                    dp,
                    cp,
                    tp,
                    lora,
                    key,
                )
            assert_grads_close(cp_grads, ref_grads, msg=(dp, cp, tp, lora))
    saved = results["elastic"]["saved"]
    assert any(k.endswith("/exp_avg_sq") for k in saved) and any(k.endswith("/step") for k in saved)
    for layout in ELASTIC_LAYOUTS:  # DCP reads each rank's new block from the saved blocks: bit for bit
        loaded = results["elastic"][layout]
        assert set(loaded) == set(saved) and all(torch.equal(loaded[k], v) for k, v in saved.items()), layout


def _ring_worker(rank: int, world: int, port: int, out_path: str, leave) -> None:
    import torch.distributed as dist

    import dockrl.parallel.context as context
    from dockrl.parallel.dist import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    context._TILE_ELEMENTS = (
        100  # tiles of 1 to 3 query rows: every tile boundary of the causal diagonal occurs
    )
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 24, 8
    q, k, v = (torch.randn(batch, n, seq, dim, generator=g) for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(batch, heads, seq, dim, generator=g)
    shard = context.ContextShard.of_group(dist.group.WORLD)
    positions = context.zigzag_positions(seq, world, rank)
    local = [x[:, :, positions].clone().requires_grad_(True) for x in (q, k, v)]
    out = context.ring_attention(*local, shard)
    out.backward(grad[:, :, positions])
    parts = [out.detach(), *(x.grad for x in local)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (positions, parts))
    if rank == 0:
        torch.save({"inputs": (q, k, v, grad), "ranks": gathered}, out_path)
    leave(rank)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_equals_causal_attention(tmp_path, cp):
    """Ring attention over cp ranks (query tiles of a few rows) equals torch's causal attention of the whole
    sequence: output and the gradients of q, k, v. Both are fp32 sums of 24 keys in another order (blocks merged by
    log-sum-exp): ~10 eps_fp32 of O(1) values, so 1e-5 absolute holds with margin; an unmerged block, a wrong chunk
    or a lost key gradient is O(0.1) off."""
    out = tmp_path / "ring.pt"
    spawn_ranks(_ring_worker, cp, free_port(), str(out))
    result = torch.load(out, weights_only=False)
    q, k, v, grad = result["inputs"]
    whole = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    ref.backward(grad)
    expected = [ref.detach(), *(x.grad for x in whole)]
    for positions, parts in result["ranks"]:
        for name, part, full in zip(("out", "dq", "dk", "dv"), parts, expected):
            torch.testing.assert_close(part, full[:, :, positions], rtol=0, atol=1e-5, msg=(cp, name))
