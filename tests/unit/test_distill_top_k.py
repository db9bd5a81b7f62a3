"""Top-k distillation (distill.top_k): the forward KL over the teacher's top-k and the tail against direct
computations from full distributions, its gradient, the fused head's log-probs of the support, the teacher's
top-k through the engine, the dock column's bytes per token, and the settings.

Shape letters: N positions, V vocabulary, k the teacher's top-k.
"""

import math

import pytest
import torch

from dockrl.algos.distill import TAIL_FLOOR, tail_mass, top_k_forward_kl
from dockrl.algos.head_logprobs import head_support_stats, head_top_k
from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.config.specs import specs
from dockrl.dock.cells import seal
from dockrl.dock.columns import TEACHER_LOGPROBS, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS, spec_of
from dockrl.engines.train.batch import make_micro_batch
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.hf import read_config
from dockrl.models.tiny import make_tiny
from dockrl.recipes.preflight import preflight_train

EPS32 = 2.0**-24  # fp32 unit roundoff


def _distributions(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student log-probs [N, V] fp32 of random logits (teacher sharper, like a trained model)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.log_softmax(2.0 * torch.randn(n, vocab, generator=g), dim=-1)
    student = torch.log_softmax(torch.randn(n, vocab, generator=g), dim=-1)
    return teacher, student


def _support(teacher: torch.Tensor, k: int) -> torch.Tensor:
    return teacher.topk(k, dim=-1).indices  # [N, k]


def test_with_the_whole_vocabulary_it_is_the_full_forward_kl():
    teacher, student = _distributions(16, 64, seed=0)
    ids = _support(teacher, 64)  # every id, most likely first
    t_k, s_k = teacher.gather(-1, ids), student.gather(-1, ids)
    # Both tails are 1 - sum of all probabilities: rounding, under the floor, so the tail term is 0 exactly.
    assert torch.equal(tail_mass(t_k), torch.full((16,), TAIL_FLOOR))
    assert torch.equal(tail_mass(s_k), torch.full((16,), TAIL_FLOOR))
    got = top_k_forward_kl(t_k, s_k)  # [N]
    terms = teacher.double().exp() * (teacher.double() - student.double())  # [N, V] fp64 of the same fp32
    full = terms.sum(-1)
    # fp32: each term rounds in exp, subtraction and product (3 EPS32 relative), the sum of V terms adds at
    # most (V - 1) EPS32 of the sum of magnitudes.
    bound = (64 + 3) * EPS32 * terms.abs().sum(-1)
    assert ((got.double() - full).abs() <= bound).all(), (got.double() - full).abs().max()
    assert (full > 0.1).all()  # distributions far apart: a real KL, not rounding


def _coarse_kl(teacher: torch.Tensor, student: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The k+1-way forward KL in fp64 with each tail summed over the ids outside the support (not 1 - sum):
    (KL [N], its support part [N], tails [N] of teacher and student)."""
    p_t, p_s = teacher.double().exp(), student.double().exp()
    outside = torch.ones_like(p_t, dtype=torch.bool).scatter(-1, ids, False)  # [N, V]
    tail_t, tail_s = (p_t * outside).sum(-1), (p_s * outside).sum(-1)
    pt_k, ps_k = p_t.gather(-1, ids), p_s.gather(-1, ids)
    support = (pt_k * (pt_k.log() - ps_k.log())).sum(-1)
    return support + tail_t * (tail_t.log() - tail_s.log()), support, tail_t, tail_s


@pytest.mark.parametrize("k", [1, 4, 16])
def test_the_tail_term_matches_the_tails_summed_from_the_full_distributions(k):
    teacher, student = _distributions(32, 64, seed=1)
    ids = _support(teacher, k)
    got = top_k_forward_kl(teacher.gather(-1, ids), student.gather(-1, ids)).double()  # [N]
    expected, support, tail_t, tail_s = _coarse_kl(teacher, student, ids)
    # Each tail from fp32 log-probs (1 - sum_S p) is within (k + 2) EPS32 of the fp64 sum over the rest; the
    # term t log(t / s) moves by dt |log(t / s) + 1| + ds t / s; the support part rounds as in the test above.
    d_tail = (k + 2) * EPS32
    tail_err = d_tail * ((tail_t / tail_s).log().abs() + 1 + tail_t / tail_s)
    bound = (k + 3) * EPS32 * (support.abs() + 1) + tail_err
    assert ((got - expected).abs() <= bound).all(), ((got - expected).abs() / bound).max()
    # The tail term is far above the bound: a loss without it would fail the comparison at every position.
    tail_term = (expected - support).abs()
    assert (tail_term > 100 * bound).all(), (tail_term / bound).min()


def test_the_coarse_kl_is_at_most_the_full_kl_and_zero_at_the_teacher():
    teacher, student = _distributions(32, 64, seed=2)
    full = (teacher.exp() * (teacher - student)).sum(-1)
    for k in (1, 4, 16, 63):
        ids = _support(teacher, k)
        coarse = top_k_forward_kl(teacher.gather(-1, ids), student.gather(-1, ids))
        # the log-sum inequality; fp32 rounding of both sides as bounded above
        assert (coarse <= full + 70 * EPS32 * full.abs().clamp(min=1)).all()
        at_teacher = top_k_forward_kl(teacher.gather(-1, ids), teacher.gather(-1, ids))
        assert torch.equal(at_teacher, torch.zeros_like(at_teacher))


def test_gradient_of_the_top_k_kl():
    """gradcheck in fp64 through the student's log-softmax; with k = V the gradient w.r.t. the student's logits
    is the full forward KL's, p_S - p_T."""
    g = torch.Generator().manual_seed(3)
    teacher = torch.log_softmax(2 * torch.randn(5, 12, generator=g, dtype=torch.float64), -1)
    logits = torch.randn(5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    for k in (1, 3, 12):
        ids = _support(teacher, k)

        def loss(z, ids=ids):
            return top_k_forward_kl(teacher.gather(-1, ids), torch.log_softmax(z, -1).gather(-1, ids))

        assert torch.autograd.gradcheck(loss, (logits,))
    ids = _support(teacher, 12)
    kl = top_k_forward_kl(teacher.gather(-1, ids), torch.log_softmax(logits, -1).gather(-1, ids)).sum()
    (grad,) = torch.autograd.grad(kl, logits)
    # fp64 throughout: the two differ by rounding of O(V) terms of size <= 1
    expected = torch.softmax(logits, -1) - teacher.exp()
    assert (grad - expected).abs().max() <= 12 * 4 * 2.0**-53


def test_fused_head_support_logprobs_and_their_gradient():
    """head_support_stats (fp32) against float64 log_softmax of the whole logits: values and gradients of a
    weighted sum of the target's and the support's log-probs, with a support that holds the target too and
    chunks that split the positions.

    Bounds, first order (tests/unit/test_head_logprobs.py derives them term by term): a logit carries
    (H + 1) u of |h| |W| / T, the lse and each p add (V + 8 + |lse|) u, so a log-prob is within
    (H + V + 16) u (1 + Z) with Z the largest |logit|; dz = sum_j g_j (onehot_j - p) / T then errs by that
    relative to D = sum_j |g_j| (onehot_j + p) / T, and the matmuls add (V or N + 1) u of |dz| @ |W| or
    |dz|.T @ |h|. A backward that drops the support's terms or their p share is off by O(1) of D."""
    g = torch.Generator().manual_seed(4)
    num, width, vocab, k = 7, 6, 11, 4
    hidden, weight = torch.randn(num, width, generator=g), torch.randn(vocab, width, generator=g) * 0.5
    targets = torch.randint(0, vocab, (num,), generator=g)
    support = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(num)])  # [N, k]
    support[:, 0] = targets  # the sampled token among the top-k, as it often is
    g_logp, g_support = torch.randn(num, generator=g), torch.randn(num, k, generator=g)

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, _, support_logp = head_support_stats(h, w, targets, support, 0.7, chunk=3)
    ((logp * g_logp).sum() + (support_logp * g_support).sum()).backward()

    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    z = h64 @ w64.T / 0.7  # [N, V]
    ref = torch.log_softmax(z, -1)
    ref_logp, ref_support = ref.gather(-1, targets[:, None])[:, 0], ref.gather(-1, support)
    ((ref_logp * g_logp.double()).sum() + (ref_support * g_support.double()).sum()).backward()

    u, big_z = 2.0**-24, float(z.detach().abs().max()) + 1
    rel = (width + vocab + 16) * u * big_z
    assert (logp.double() - ref_logp).abs().max() <= rel
    assert (support_logp.double() - ref_support).abs().max() <= rel
    p = ref.exp().detach()  # [N, V]
    ids = torch.cat([targets[:, None], support], -1)
    grads = torch.cat([g_logp[:, None], g_support], -1).double().abs()  # [N, 1 + k]
    onehot = torch.zeros(num, vocab, dtype=torch.float64).scatter_add(-1, ids, grads)
    dz_mag = (onehot + grads.sum(-1, keepdim=True) * p) / 0.7  # D [N, V]
    bound_h = (rel + (vocab + 1) * u) * (dz_mag @ weight.double().abs())
    bound_w = (rel + (num + 1) * u) * (dz_mag.T @ hidden.double().abs())
    assert ((h.grad.double() - h64.grad).abs() <= bound_h).all()
    assert ((w.grad.double() - w64.grad).abs() <= bound_w).all()


def test_head_top_k_is_the_top_k_of_the_log_softmax():
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 40, (9,), generator=g)
    logp, ids, top = head_top_k(hidden, weight, targets, 5, 0.8, chunk=4)
    ref = torch.log_softmax(hidden @ weight.T / 0.8, -1)  # [N, V]
    ref_top = ref.topk(5, -1)
    assert torch.equal(ids, ref_top.indices)
    # the same fp32 logits; lse summed in another order: V EPS32 of a log
    assert (top - ref_top.values).abs().max() <= 40 * EPS32 * 8
    assert (logp - ref.gather(-1, targets[:, None])[:, 0]).abs().max() <= 40 * EPS32 * 8
    # ids past `num_ids` (a teacher embedding's extra rows) are never chosen, and still count in the softmax
    _, few_ids, few_top = head_top_k(hidden, weight, targets, 5, 0.8, num_ids=30)
    assert (few_ids < 30).all()
    assert torch.equal(few_ids, ref[:, :30].topk(5, -1).indices)
    with pytest.raises(ValueError, match=r"k must be in \[1, 30\]"):
        head_top_k(hidden, weight, targets, 31, num_ids=30)


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("teacher") / "model", hidden_size=64, num_layers=2, seed=7)


def _rows(vocab: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, vocab, (3 + i,), generator=g) for i in range(4)]
    responses = [torch.randint(0, vocab, (2 + 2 * i,), generator=g) for i in range(4)]
    return prompts, responses


def test_teacher_top_k_through_the_engine_and_the_columns_bytes_per_token(teacher_model):
    """TrainEngine.top_k_logprobs equals the top-k of the whole logits' log-softmax row by row, its log-probs of
    the sampled tokens equal `logprobs`', and the column sealed for the dock holds 8k bytes per response token
    (ids int32 and log-probs fp32) against the sampled form's 4: never the vocabulary's 4V."""
    engine = TrainEngine(str(teacher_model), device="cpu", precision="fp32", trainable=False)
    prompts, responses = _rows(engine.args.vocab_size)
    k = 8
    kw = dict(temperature=0.7, micro_batch_size=2, pad_token_id=0)
    logps, ids, top = engine.top_k_logprobs(prompts, responses, k, **kw)
    sampled, _ = engine.logprobs(prompts, responses, **kw)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        mb = make_micro_batch([p], [r], pad_token_id=0)
        with torch.no_grad():
            full = torch.log_softmax(engine.logits(mb)[0, len(p) - 1 :].float() / 0.7, -1)  # [R, V]
        ref = full.topk(k, -1)
        assert ids[i].dtype == torch.int32 and ids[i].shape == (len(r), k)
        assert torch.equal(ids[i].long(), ref.indices)
        # the fused head and the logits' log-softmax sum V exps in other orders (V EPS32 of |log-probs| < 16)
        assert (top[i] - ref.values).abs().max() <= engine.args.vocab_size * EPS32 * 16
        assert torch.equal(logps[i], sampled[i])
    tokens = sum(len(r) for r in responses)
    top_k_bytes = sum(len(seal(t).data) for t in (*ids, *top))
    sampled_bytes = sum(len(seal(t).data) for t in sampled)
    assert top_k_bytes == 8 * k * tokens and sampled_bytes == 4 * tokens
    assert spec_of(TEACHER_TOPK_IDS).dtype == "int32" and spec_of(TEACHER_TOPK_LOGPROBS).dtype == "float32"
    assert spec_of(TEACHER_LOGPROBS).dtype == "float32"


def test_the_update_trains_on_the_top_k_kl(tiny_model, teacher_model):
    """One policy_update of opd with distill.top_k: the loss is distill.coef x the token-mean top-k KL (the
    advantages are 0), its value is the KL computed from the student's own logits, and the step lowers it."""
    from dockrl.config import AlgoConfig, loss_plan
    from dockrl.config.schema import ActorConfig, DistillConfig
    from dockrl.engines.train.policy_update import policy_update

    teacher = TrainEngine(str(teacher_model), device="cpu", precision="fp32", trainable=False)
    student = TrainEngine(
        str(tiny_model), device="cpu", precision="fp32", optim=ActorConfig(lr=1e-2, grad_clip=0.0)
    )
    prompts, responses = _rows(student.args.vocab_size)
    k = 6
    _, ids, top = teacher.top_k_logprobs(
        prompts, responses, k, temperature=1.0, micro_batch_size=4, pad_token_id=0
    )
    batch = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "advantages": [torch.zeros(len(r)) for r in responses],
        TEACHER_TOPK_IDS: ids,
        TEACHER_TOPK_LOGPROBS: top,
    }
    plan = loss_plan(AlgoConfig(name="opd"), distill=DistillConfig(teacher_path="t", coef=0.5, top_k=k))
    assert plan.distill_coef == 0.5

    def direct_kl() -> float:
        total, tokens = 0.0, 0
        for p, r, row_ids, row_top in zip(prompts, responses, ids, top):
            with torch.no_grad():
                logits = student.logits(make_micro_batch([p], [r], pad_token_id=0))[0, len(p) - 1 :]
            s_k = torch.log_softmax(logits.float(), -1).gather(-1, row_ids.long())
            total += float(top_k_forward_kl(row_top, s_k).sum())
            tokens += len(r)
        return total / tokens

    before = direct_kl()
    update = dict(temperature=1.0, micro_batch_size=2, pad_token_id=0, world_size=1)
    metrics = policy_update(student, batch, list(range(4)), ["advantages"], plan, **update)
    assert metrics is not None
    # fp32 token means over ~20 tokens of O(1) KLs, through two log-softmax paths (fused head, logits)
    assert metrics["distill/topk_kl"] == pytest.approx(before, rel=1e-5)
    assert metrics["loss"] == pytest.approx(0.5 * before, rel=1e-5) and metrics["pg_loss"] == 0.0
    assert 0 < metrics["distill/teacher_tail_mass"] < 1
    assert direct_kl() < before  # one AdamW step at lr 1e-2 on the KL itself lowers it


def test_top_k_settings(tmp_path, tiny_model, teacher_model, arithmetic_data):
    base = [
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        "run.steps=1",
        "run.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        "algo.name=opd",
        f"distill.teacher_path={teacher_model}",
    ]
    with pytest.raises(ConfigError, match=r"distill.top_k=-1: must be >= 0"):
        preflight_train(load_config(TrainConfig, None, [*base, "distill.top_k=-1"]))
    vocab = read_config(str(tiny_model)).vocab_size
    with pytest.raises(
        ConfigError, match=rf"distill.top_k={vocab + 1}: exceeds the policy's vocab_size={vocab}"
    ):
        preflight_train(load_config(TrainConfig, None, [*base, f"distill.top_k={vocab + 1}"]))
    resolved = preflight_train(
        load_config(TrainConfig, None, [*base, "distill.top_k=16", "distill.coef=0.5"])
    )
    assert resolved.plan.distill_top_k == 16 and resolved.plan.loss.distill_coef == 0.5
    # the teacher term is in the loss, not the advantages
    assert specs(resolved.cfg, resolved.plan).reward.distill_coef is None
    sampled = preflight_train(load_config(TrainConfig, None, base))
    assert sampled.plan.distill_top_k == 0 and sampled.plan.loss.distill_coef == 0.0
    assert specs(sampled.cfg, sampled.plan).reward.distill_coef == 1.0
    assert math.isclose(TAIL_FLOOR, 2.0**-20)
