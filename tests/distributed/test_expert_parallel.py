"""Expert parallelism (actor.ep): a policy update of a tiny Qwen3-MoE over 4 gloo processes with ep=1 (plain
FSDP2), ep=2 (experts split in two, FSDP2 over the 2 ranks holding each half) and ep=4 (one rank per two experts)
gives the single-process update's loss and gradients; with routing replay too. A checkpoint written under ep=2
loads under ep=4 and ep=1 with the same values, and the Hugging Face export of ep=2 equals the single process's.
LoRA on the attention of an MoE model (experts frozen, split over ep) trains the same adapters under ep=2.
The router's load-balancing loss is logged, and trained on with actor.moe_aux_loss_coef.
"""

import torch

from dockrl.config import ActorConfig, AlgoConfig, loss_plan
from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks
from helpers import assert_grads_close, full_grads

NUM_ROWS, WORLD, EXPERTS, TOP_K, LAYERS = 8, 4, 8, 2, 2
ALGO = AlgoConfig(kl_coef=0.05, clip_low=0.2, clip_high=0.28)
# (ep, replay): plain FSDP2 (ep=1), experts split in two with and without replayed routes, one rank per two
# experts with replay
CASES = ((1, False), (2, False), (2, True), (4, True))


def write_moe(path) -> str:
    """A tiny random Qwen3-MoE directory (no tokenizer), routers spread over the experts."""
    from dockrl.models.config import ModelArgs
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import save_model
    from helpers import perturb_

    args = ModelArgs(
        family="qwen3_moe",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_id=1,
        pad_token_id=0,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=16,
    )
    model = Transformer(args)
    perturb_(model, seed=2)
    save_model(model, args, path)
    return str(path)


def make_rows(vocab: int, with_routes: bool) -> dict[str, list]:
    """Ragged rows with per-token columns; with_routes adds experts per fed token to replay (random, so the
    trainer's router disagrees with most of them)."""
    g = torch.Generator().manual_seed(0)
    batch: dict[str, list] = {
        k: [] for k in ("prompt_ids", "response_ids", "advantages", "ref_logprobs", "old_logprobs")
    }
    for i in range(NUM_ROWS):
        p, r = 3 + i % 4, 2 + (i * 3) % 7
        batch["prompt_ids"].append(torch.randint(0, vocab, (p,), generator=g))
        batch["response_ids"].append(torch.randint(0, vocab, (r,), generator=g))
        batch["advantages"].append(torch.full((r,), float(torch.randn(1, generator=g))))
        batch["ref_logprobs"].append(-torch.rand(r, generator=g) * 5)
        batch["old_logprobs"].append(-torch.rand(r, generator=g) * 5)
        if with_routes:
            scores = torch.rand(p + r - 1, LAYERS, EXPERTS, generator=g)
            batch.setdefault("routed_experts", []).append(scores.topk(TOP_K, dim=-1).indices.to(torch.int16))
    return batch


def make_engine(
    model_dir: str,
    mesh=None,
    ep: int = 1,
    load_weights: bool = True,
    grad_clip: float = 1.0,
    lora: bool = False,
):
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.lora import LoraSpec

    optim = ActorConfig(lr=1e-2, grad_clip=grad_clip, micro_batch_size=2)
    spec = LoraSpec(4, 8.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj")) if lora else None
    return TrainEngine(
        model_dir,
        device="cpu",
        precision="fp32",
        mesh=mesh,
        optim=optim,
        ep=ep,
        load_weights=load_weights,
        lora=spec,
    )


def adapter_grads(engine) -> dict[str, torch.Tensor]:
    """The whole gradients of the trained parameters (LoRA: the adapters)."""
    from dockrl.parallel.layout import full_tensor

    return {
        name: full_tensor(param.grad, engine.placement(name)).detach().clone()
        for name, param in engine.model.named_parameters()
        if param.requires_grad
    }


def run_update(engine, idx: list[int], dp: int, replay: bool, aux_loss_coef: float = 0.0) -> dict:
    from dockrl.engines.train.policy_update import policy_update

    batch = make_rows(engine.args.vocab_size, with_routes=replay)
    return policy_update(
        engine,
        batch,
        idx,
        ["advantages", "ref_logprobs", "old_logprobs"],
        loss_plan(ALGO),
        temperature=1.0,
        micro_batch_size=2,
        pad_token_id=0,
        world_size=dp,
        replay=replay,
        aux_loss_coef=aux_loss_coef,
    )


def _worker(rank: int, world: int, port: int, model_dir: str, tmp: str, leave) -> None:
    from dockrl.checkpoint.sharded import export_hf, load_engine, save_engine
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed
    from dockrl.parallel.expert_parallel import ALL_TO_ALL_BYTES

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    mesh = data_parallel_mesh("cpu", world)
    per_rank = NUM_ROWS // world
    idx = list(range(rank * per_rank, (rank + 1) * per_rank))
    results: dict = {}
    engines = {}
    for ep, replay in CASES:
        engine = engines[(ep, replay)] = make_engine(model_dir, mesh, ep)
        sent = ALL_TO_ALL_BYTES[0]
        metrics = run_update(engine, idx, world, replay)
        results[(ep, replay)] = metrics, full_grads(engine), ALL_TO_ALL_BYTES[0] - sent
        results[(ep, replay, "shapes")] = {
            n: tuple(p.to_local().shape) for n, p in engine.model.named_parameters() if "experts" in n
        }
    lora = make_engine(model_dir, mesh, 2, lora=True)
    results["lora"] = run_update(lora, idx, world, replay=True), adapter_grads(lora)
    # ep=2 after its update (an optimizer step): its checkpoint loads under ep=4 and ep=1 (DCP reshards experts
    # by offset)
    engine = engines[(2, False)]
    save_engine(engine, f"{tmp}/ckpt")
    export_hf(engine, f"{tmp}/export", tokenizer_dir=None)
    results["saved"] = engine.full_state_dict()
    for ep in (4, 1):
        other = make_engine(model_dir, mesh, ep, load_weights=False)
        load_engine(other, f"{tmp}/ckpt")
        results[("loaded", ep)] = other.full_state_dict()
    if rank == 0:
        torch.save(results, f"{tmp}/results.pt")
    leave(rank)


def test_expert_parallel_updates_equal_single_process(tmp_path):
    from dockrl.models.hf import load_state_dict

    model_dir = write_moe(tmp_path / "moe")
    spawn_ranks(_worker, WORLD, free_port(), model_dir, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    for replay in (False, True):
        reference = make_engine(model_dir)
        ref_metrics = run_update(reference, list(range(NUM_ROWS)), 1, replay)
        ref_grads = full_grads(reference)
        assert ref_metrics["grad_norm"] > 0
        if replay:  # random routes: the trainer's own top-k set matches few of them
            assert ref_metrics["moe/routing_agreement"] < 0.5
        for ep in [ep for ep, with_replay in CASES if with_replay == replay]:
            metrics, grads, sent = results[(ep, replay)]
            for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "moe/routing_agreement"):
                if key in ref_metrics:
                    # O(1) fp32 sums of a few hundred terms: rounding stays near 1e-5 relative (helpers.GRAD_RTOL)
                    torch.testing.assert_close(
                        metrics[key], ref_metrics[key], rtol=1e-4, atol=1e-6, msg=(ep, replay, key)
                    )
            assert_grads_close(grads, ref_grads, msg=(ep, replay))
            # rank 0's experts: E/ep of them, FSDP2 rows over the dp/ep ranks that hold the same ones
            shapes = results[(ep, replay, "shapes")]
            local = EXPERTS // ep
            rows = -(-local // (WORLD // ep))
            assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (rows, 32, 32)
            assert (sent > 0) == (ep > 1)
    # LoRA on the attention, experts frozen and split: the single process's adapter gradients
    reference = make_engine(model_dir, lora=True)
    ref_metrics = run_update(reference, list(range(NUM_ROWS)), 1, replay=True)
    metrics, grads = results["lora"]
    torch.testing.assert_close(metrics["loss"], ref_metrics["loss"], rtol=1e-4, atol=1e-6)
    assert len(grads) == 4 * 2 * LAYERS  # A and B of q, k, v, o per layer
    expected = adapter_grads(reference)
    # B starts at zero, so A's first gradient is zero everywhere; B's carries the update
    assert all(float(g.abs().max()) == 0 for n, g in {**grads, **expected}.items() if n.endswith("lora_A"))
    assert_grads_close(
        {n: g for n, g in grads.items() if n.endswith("lora_B")},
        {n: g for n, g in expected.items() if n.endswith("lora_B")},
    )
    # a checkpoint of ep=2 loads under ep=4 and ep=1 with the same values, bit for bit
    saved = results["saved"]
    for ep in (4, 1):
        loaded = results[("loaded", ep)]
        assert set(loaded) == set(saved)
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (ep, name)
    exported = load_state_dict(tmp_path / "export")
    assert set(exported) == set(saved)
    for name, value in saved.items():
        assert torch.equal(exported[name], value), name


def test_load_balancing_loss_is_logged_and_trained_with_its_weight(tmp_path):
    from dockrl.engines.train.batch import make_micro_batch, micro_batch_rows
    from dockrl.models.moe import load_balancing_loss, router_logits

    model_dir = write_moe(tmp_path / "moe")
    rows = list(range(NUM_ROWS))
    logged = make_engine(model_dir, grad_clip=0.0)  # no clipping: gradients add up exactly
    metrics = run_update(logged, rows, 1, replay=False)
    trained = make_engine(model_dir, grad_clip=0.0)
    coef = 0.5
    metrics_trained = run_update(trained, rows, 1, replay=False, aux_loss_coef=coef)
    # the same forwards: the same figure, the mean over micro-batches of each one's loss over its tokens
    reference = make_engine(model_dir)
    batch = make_rows(reference.args.vocab_size, with_routes=False)
    lengths = [len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"])]
    chunks = micro_batch_rows(lengths, 2, 0)
    losses = []
    for chunk in chunks:
        mb = make_micro_batch(
            [batch["prompt_ids"][i] for i in chunk], [batch["response_ids"][i] for i in chunk], pad_token_id=0
        )
        with router_logits(reference.model) as logits:
            reference.model(mb.input_ids)
        losses.append(load_balancing_loss(logits, TOP_K, EXPERTS, mb.token_mask().reshape(-1)))
    expected = torch.stack(losses)
    assert 1.0 <= float(expected.min())  # E x sum of shares x mean probabilities >= 1 (k=2: ~2 when even)
    torch.testing.assert_close(metrics["moe/aux_loss"], float(expected.mean()), rtol=1e-5, atol=0)
    torch.testing.assert_close(metrics_trained["moe/aux_loss"], metrics["moe/aux_loss"], rtol=1e-6, atol=0)
    # with the weight, the gradients move by coef x the gradient of the micro-batches' mean aux loss
    (coef * expected.mean()).backward()
    base, with_aux = full_grads(logged), full_grads(trained)
    for name, param in reference.model.named_parameters():
        if param.grad is None:  # the LM head and final norm do not feed the routers
            torch.testing.assert_close(with_aux[name], base[name], rtol=0, atol=0)
            continue
        scale = float(base[name].abs().max()) + float(param.grad.abs().max())
        # fp32 reassociation of two separately summed gradients (helpers.GRAD_ATOL_OF_SCALE)
        torch.testing.assert_close(with_aux[name] - base[name], param.grad, rtol=0, atol=1e-4 * scale)
    assert float(reference.model.model.layers[1].mlp.gate.weight.grad.abs().max()) > 1e-3
