"""The training engine's optimizer: torch's fused AdamW (one kernel per parameter on a CPU) takes the for-loop
AdamW's steps up to the rounding of each step's few ops (its kernel orders them its own way)."""

from __future__ import annotations

import torch

from dockrl.config.schema import ActorConfig
from dockrl.engines.train.batch import make_micro_batch
from dockrl.engines.train.train_engine import TrainEngine

U32 = 2.0**-24  # fp32 unit roundoff


def _loss(stats, mb):
    logp, entropy = stats
    return -(logp * mb.response_mask).sum() - 0.01 * (entropy * mb.response_mask).sum(), {}


def test_fused_adamw_takes_the_for_loop_steps_bit_for_bit(tiny_model):
    """Three updates of the engine (its fused AdamW, weight decay on, the LR warming up), replayed by the
    for-loop AdamW on a copy of the starting parameters with the engine's gradients and LRs. Each step rounds
    the new parameter once (2u |p_t| apart at most: one ulp) and computes its update with ~8 roundings in
    another order (8u |p_t - p_(t-1)|), and earlier differences carry: every element ends within
    sum_t (2u |p_t| + 8u |p_t - p_(t-1)|) of the engine's (u = 2^-24). The same replay with beta1 0.8 instead of
    0.9 ends outside that (the check can fail)."""
    optim = ActorConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2)
    engine = TrainEngine(
        str(tiny_model), device="cpu", precision="fp32", optim=optim, total_optimizer_steps=3
    )
    assert engine.optimizer is not None and engine.optimizer.defaults["fused"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g) for n in (4, 7)]
    responses = [torch.randint(3, 400, (n,), generator=g) for n in (6, 3)]
    params = [p for p in engine.model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    steps = []  # (lr, gradients) of each engine step
    bounds = [torch.zeros_like(p) for p in start]
    for _ in range(3):
        lr = engine.optimizer.param_groups[0]["lr"]
        before = [p.detach().clone() for p in params]
        mb = make_micro_batch(prompts, responses, pad_token_id=0)
        engine.train_step([mb], _loss, lambda mb: engine.token_stats(mb, 1.0))
        steps.append((lr, [p.grad.detach().clone() for p in params]))
        for bound, old, p in zip(bounds, before, params):
            bound += 2 * U32 * p.detach().abs() + 8 * U32 * (p.detach() - old).abs()

    def replay(beta1):
        copies = [torch.nn.Parameter(p.clone()) for p in start]
        adam = torch.optim.AdamW(
            copies,
            lr=optim.lr,
            betas=(beta1, optim.adam_beta2),
            eps=optim.adam_eps,
            weight_decay=optim.weight_decay,
            foreach=False,
        )
        for lr, grads in steps:
            adam.param_groups[0]["lr"] = lr
            for copy, grad in zip(copies, grads):
                copy.grad = grad
            adam.step()
        return copies

    def within(copies):
        return all(((c.detach() - p.detach()).abs() <= b).all() for c, p, b in zip(copies, params, bounds))

    assert len({lr for lr, _ in steps}) > 1  # the schedule moved the LR between steps
    assert within(replay(optim.adam_beta1))
    assert not within(replay(0.8))
