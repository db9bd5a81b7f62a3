"""Top-k distillation over a vocab-sharded LM head: 2 gloo processes, the teacher's top-k (head_top_k and
TrainEngine.top_k_logprobs at tp=2) and the student's support log-probs (head_support_stats) against one process.

Each rank holds half the vocabulary: its local top-k, all-gathered, then a top-k of the candidates must give
the unsplit vocabulary's ids. Ids are compared exactly where a position's top-k+1 logits are separated by more
than the log-probs' tolerance (a tie that close may order either way); the log-probs everywhere.
"""

import torch

from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks

K = 8
EPS32 = 2.0**-24


def _separated(values: torch.Tensor, tol: float) -> torch.Tensor:
    """[N] bool: the sorted log-probs [N, k+1] of each position differ by more than 2 tol between neighbours."""
    return (values[:, :-1] - values[:, 1:] > 2 * tol).all(-1)


def _functions(rank: int, world: int) -> dict:
    """head_top_k and head_support_stats on this rank's vocab slice; the whole-head results for comparison."""
    import torch.distributed as dist

    from dockrl.algos.head_logprobs import head_support_stats, head_top_k

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(13, 8, generator=g), torch.randn(64, 8, generator=g)  # [N, H], [V, H]
    targets = torch.randint(0, 64, (13,), generator=g)
    width = 64 // world
    rows = slice(rank * width, (rank + 1) * width)
    group = dist.group.WORLD
    local = head_top_k(hidden, weight[rows], targets, K, 0.9, vocab_start=rank * width, group=group, chunk=5)
    whole = head_top_k(hidden, weight, targets, K + 1, 0.9)  # one more: the gap below the k-th
    # a k larger than one slice: each rank's local top-k is its whole slice
    wide = head_top_k(hidden, weight[rows], targets, width + 3, 0.9, vocab_start=rank * width, group=group)
    wide_whole = head_top_k(hidden, weight, targets, width + 4, 0.9)
    support = whole[1][:, :K]
    h = hidden.clone().requires_grad_(True)
    w = weight[rows].clone().requires_grad_(True)
    _, _, support_logp = head_support_stats(
        h, w, targets, support, 0.9, vocab_start=rank * width, group=group
    )
    g_support = torch.randn(13, K, generator=g)
    (support_logp * g_support).sum().backward()
    grad_h = h.grad.clone()
    dist.all_reduce(grad_h)  # copy_to_tp's sum over the tp ranks
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    _, _, ref_support = head_support_stats(h1, w1, targets, support, 0.9)
    (ref_support * g_support).sum().backward()
    return {
        "local": local,
        "whole": whole,
        "wide": wide,
        "wide_whole": wide_whole,
        "support": (support_logp.detach(), ref_support.detach()),
        "grads": (grad_h, h1.grad, w.grad, w1.grad[rows]),
    }


def _engines(rank: int, world: int, model_dir: str) -> dict:
    """TrainEngine.top_k_logprobs with the teacher split over tp = world (dp 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.engines.train.train_engine import TrainEngine

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    engine = TrainEngine(model_dir, device="cpu", precision="fp32", mesh=mesh, trainable=False)
    prompts, responses = _rows(engine.args.vocab_size)
    return dict(
        zip(
            ("logp", "ids", "top"),
            engine.top_k_logprobs(prompts, responses, K, temperature=0.7, micro_batch_size=2, pad_token_id=0),
        )
    )


def _rows(vocab: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (3 + i,), generator=g) for i in range(3)]
    responses = [torch.randint(0, vocab, (4 + i,), generator=g) for i in range(3)]
    return prompts, responses


def _worker(rank: int, world: int, port: int, model_dir: str, out_path: str, leave) -> None:
    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {"functions": _functions(rank, world), "engine": _engines(rank, world, model_dir)}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)
    leave(rank)


def test_top_k_over_a_vocab_sharded_head_equals_the_unsharded(tmp_path, tiny_model):
    from dockrl.engines.train.train_engine import TrainEngine

    out = tmp_path / "results.pt"
    spawn_ranks(_worker, 2, free_port(), str(tiny_model), str(out))
    ranks = torch.load(out, weights_only=False)

    # Functions: the same fp32 logits per id (a slice's rows of W), the lse summed over two slices: the log-probs
    # differ by the lse's rounding, (V + 8 + |lse|) u (tests/unit/test_head_logprobs.py), |lse| < 2^4 here.
    tol = (64 + 8 + 16) * EPS32
    for result in ranks:  # every rank holds the whole result
        f = result["functions"]
        logp, ids, top = f["local"]
        whole_logp, whole_ids, whole_top = f["whole"]
        assert (logp - whole_logp).abs().max() <= tol
        assert (top - whole_top[:, :K]).abs().max() <= tol
        clear = _separated(whole_top, tol)
        assert clear.sum() >= 10  # most positions have no near-tie: the ids are checked there
        assert torch.equal(ids[clear], whole_ids[clear, :K])
        _, wide_ids, wide_top = f["wide"]
        assert (wide_top - f["wide_whole"][2][:, :-1]).abs().max() <= tol
        clear = _separated(f["wide_whole"][2], tol)
        assert clear.sum() >= 10 and torch.equal(wide_ids[clear], f["wide_whole"][1][clear, :-1])
        support, ref_support = f["support"]
        assert (support - ref_support).abs().max() <= tol
        grad_h, ref_grad_h, grad_w, ref_grad_w = f["grads"]
        # dz differs by p's relative rounding (tol), then H = 8 or N = 13 products summed: well inside 4 tol
        # of the gradients' scale, while a missing slice or an unsummed tp part is O(1) of it
        assert (grad_h - ref_grad_h).abs().max() <= 4 * tol * ref_grad_h.abs().max()
        assert (grad_w - ref_grad_w).abs().max() <= 4 * tol * ref_grad_w.abs().max()

    # The engine at tp=2 against one process: the decoder's row-parallel sums (o_proj, down_proj) add two halves
    # of H = 64 products in another order, twice per layer in 2 layers, and the head's lse sums two slices.
    # Through O(1)-conditioned layers that is a few hundred u; 2^-14 (1024 u) leaves room, and a wrong vocab
    # offset or a rank's candidates left out moves ids or log-probs by O(1).
    single = TrainEngine(str(tiny_model), device="cpu", precision="fp32", trainable=False)
    prompts, responses = _rows(single.args.vocab_size)
    ref_logp, ref_ids, ref_top = single.top_k_logprobs(
        prompts, responses, K + 1, temperature=0.7, micro_batch_size=2, pad_token_id=0
    )
    tol = 2.0**-14
    for result in ranks:
        engine = result["engine"]
        checked = 0
        for i in range(len(prompts)):
            assert (engine["logp"][i] - ref_logp[i]).abs().max() <= tol
            assert (engine["top"][i] - ref_top[i][:, :K]).abs().max() <= tol
            clear = _separated(ref_top[i], tol)
            assert torch.equal(engine["ids"][i][clear], ref_ids[i][clear, :K])
            checked += int(clear.sum())
        assert checked >= 10
