"""Tensor-parallel training: (dp, tp) in (1,1), (2,1), (1,2), (2,2) (and tp=4) take the same update as one process.

One spawn of 4 gloo processes runs every case in sequence: a mesh (rep, dp, tp) with rep = 4 / (dp x tp)
gives each case its own (dp, tp) sub-mesh, the replicas computing the same thing. Vocab-parallel log-probs
and entropy are checked against the single-process functions, values and gradients.
"""

import pytest
import torch

from dockrl.config import ActorConfig, AlgoConfig, loss_plan
from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks
from helpers import assert_grads_close, full_grads

NUM_ROWS = 8
ALGO = AlgoConfig(kl_coef=0.05, clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
CASES = {  # model -> (dp, tp) layouts
    "qwen2": [(1, 1), (2, 1), (1, 2), (2, 2)],
    "qwen3": [(1, 2), (2, 2), (1, 4)],
    "llama": [(2, 2), (1, 4)],
}
BF16_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # qwen2 in bf16; (1, 1) is the reference
# bf16 layouts against bf16 dp=1 x tp=1 (both through FSDP2's bf16 weights): besides the gradient matmuls' rounding
# before the fp32 sums (see test_dp_equivalence), a row-parallel layer (o_proj, down_proj) sums tp partial outputs,
# each rounded to bf16 (u = 2^-9), and so does a vocab-parallel head's backward: about 4 roundings per decoder
# layer, forward and backward, in the 2-layer model, which O(1)-conditioned layers carry to the gradients. So each
# gradient element stays within 32u of its tensor's scale; a wrong shard or a missing partial sum is O(1).
BF16_GRAD_ATOL_OF_SCALE = 32 * 2.0**-9


def write_model(path, family: str, *, num_kv_heads: int = 4, seed: int = 0, hidden_size: int = 32):
    """A tiny random model directory (no tokenizer): 4 heads, biases everywhere the family allows."""
    from dockrl.models.config import ModelArgs
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import save_model

    args = ModelArgs(
        family=family,
        vocab_size=256,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // 4,
        max_position_embeddings=128,
        tie_word_embeddings=family != "llama",
        attention_bias=True,
        qk_norm=family == "qwen3",
        eos_token_id=1,
        pad_token_id=0,
    )
    model = Transformer(args)
    model.init_weights(seed)
    save_model(model, args, path)
    return path


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


def run_update(model_dir: str, idx: list[int], dp: int, mesh=None, precision: str = "fp32"):
    """One policy update on rows idx; returns (metrics, whole gradients before the optimizer step)."""
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine

    optim = ActorConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=2)
    engine = TrainEngine(model_dir, device="cpu", precision=precision, mesh=mesh, optim=optim)
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
    return metrics, full_grads(engine)


def _check_head_stats_over_tp(rank: int, world: int) -> dict:
    """head_token_stats over vocab slices of the LM head (tp = world) against the logits of the whole head: values,
    the hidden states' gradient (summed over ranks, as copy_to_tp does) and this rank's rows of the weight's."""
    import torch.distributed as dist

    from dockrl.algos.head_logprobs import head_token_stats
    from dockrl.algos.logprobs import token_entropy, token_logprobs

    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(16, 8, generator=g)  # [N, H], [V, H]
    targets = torch.randint(0, 16, (10,), generator=g)
    weights = torch.randn(2, 10, generator=g)
    full_h, full_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = full_h @ full_w.T  # [N, V]
    ref_logp, ref_entropy = token_logprobs(logits, targets, 0.8), token_entropy(logits, 0.8)
    ((ref_logp * weights[0]).sum() + (ref_entropy * weights[1]).sum()).backward()
    width = 16 // world
    rows = slice(rank * width, (rank + 1) * width)
    local_h, local_w = hidden.clone().requires_grad_(True), weight[rows].clone().requires_grad_(True)
    logp, entropy = head_token_stats(
        local_h, local_w, targets, 0.8, vocab_start=rank * width, group=dist.group.WORLD, chunk=3
    )
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    grad_h = local_h.grad.clone()
    dist.all_reduce(grad_h)
    return {
        "value_error": float(torch.maximum((logp - ref_logp).abs(), (entropy - ref_entropy).abs()).max()),
        "grad_error": float(
            torch.maximum((grad_h - full_h.grad).abs().max(), (local_w.grad - full_w.grad[rows]).abs().max())
        ),
    }


def _worker(rank: int, world: int, port: int, model_dirs: dict, out_path: str, leave) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {"functions": _check_head_stats_over_tp(rank, world)}
    cases = [(f, layout, "fp32") for f, layouts in CASES.items() for layout in layouts]
    cases += [("qwen2", layout, "bf16") for layout in BF16_LAYOUTS]
    for family, (dp, tp), precision in cases:
        mesh = init_device_mesh("cpu", (world // (dp * tp), dp, tp), mesh_dim_names=("rep", "dp", "tp"))
        per_rank = NUM_ROWS // dp
        dp_rank = mesh["dp"].get_local_rank()
        idx = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        key = (family, dp, tp) if precision == "fp32" else (family, dp, tp, precision)
        results[key] = run_update(model_dirs[family], idx, dp, mesh["dp", "tp"], precision)
    all_results = [None] * world
    torch.distributed.all_gather_object(all_results, results["functions"])
    if rank == 0:
        results["functions"] = all_results
        torch.save(results, out_path)
    leave(rank)


def test_tp_and_dp_layouts_equal_single_process(tmp_path, tiny_model):
    model_dirs = {
        "qwen2": str(tiny_model),
        "qwen3": str(write_model(tmp_path / "qwen3", "qwen3")),
        "llama": str(write_model(tmp_path / "llama", "llama", num_kv_heads=4)),
    }
    out = tmp_path / "results.pt"
    spawn_ranks(_worker, 4, free_port(), model_dirs, str(out))
    results = torch.load(out, weights_only=False)
    for rank_result in results["functions"]:
        assert rank_result["value_error"] < 1e-4 and rank_result["grad_error"] < 1e-4, rank_result
    for family, layouts in CASES.items():
        ref_metrics, ref_grads = run_update(model_dirs[family], list(range(NUM_ROWS)), dp=1)
        assert ref_metrics["grad_norm"] > 0 and ref_metrics["entropy"] > 0
        for dp, tp in layouts:
            metrics, grads = results[(family, dp, tp)]
            for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac"):
                # O(1) fp32 sums of a few hundred terms: rounding stays near 1e-5 relative (helpers.GRAD_RTOL).
                assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (
                    family,
                    dp,
                    tp,
                    key,
                )
            assert_grads_close(grads, ref_grads, msg=(family, dp, tp))
    bf16_metrics, bf16_grads = results[("qwen2", 1, 1, "bf16")]
    assert bf16_metrics["grad_norm"] > 0
    for dp, tp in BF16_LAYOUTS[1:]:
        metrics, grads = results[("qwen2", dp, tp, "bf16")]
        for name, ref in bf16_grads.items():
            scale = float(ref.abs().max())
            diff = float((grads[name] - ref).abs().max())
            assert scale > 0 and diff <= BF16_GRAD_ATOL_OF_SCALE * scale, (dp, tp, name, diff / scale)
