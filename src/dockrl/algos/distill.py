"""On-policy distillation's per-token signal: the student samples, a teacher scores each sampled token.

For a response y sampled from the student pi_s, the reverse KL to the teacher pi_t is

    KL(pi_s || pi_t) = E_{y ~ pi_s} [ sum_t log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t) ]

and its policy gradient, taken token by token with no discount (each token's own term, Lu et al. 2025,
"On-Policy Distillation"; Agarwal et al. 2024, GKD), is the policy gradient of the per-token advantage

    A_t = coef x (log pi_t(y_t) - log pi_s(y_t))          (the negative per-token reverse KL)

where log pi_s is the log-prob under the policy that sampled the token (the rollout's `rollout_logprobs`).
Rows sampled by older weights are corrected only by algo.rollout_is (one update per step, the default, has
ratio 1: docs/distillation.md, "Stale rows"). The teacher's
log-prob is taken at the rollout's temperature, as the student's is, so at temperature 1 this is the plain
reverse KL. `algo.name=opd` trains on A_t alone; any other group algorithm adds it to its broadcast sequence
advantage (`distill.coef` weighs the two).

The top-k form (distill.top_k = k > 0) is a loss instead: at each response position the teacher's k most
likely ids S with their log-probs (the dock's teacher_topk_* columns), the student's log-probs of the same ids
(from its logits, through the fused head), and each side's tail mass 1 - sum_S p give two k+1-way distributions;
the loss is the forward KL between them

    KL_k(p_T || p_S) = sum_{i in S} p_T(i) (log p_T(i) - log p_S(i)) + p_T(tail) (log p_T(tail) - log p_S(tail))

which is the full forward KL when S is the whole vocabulary, and never more than it (grouping the tail's ids
into one outcome loses information: the log-sum inequality). Forward, because the teacher's top-k is where
p_T's mass is: weighting by p_T over S (and its tail as one outcome) is then nearly the whole KL(p_T || p_S),
while a reverse KL weighs by p_S, whose mass may sit on ids whose teacher log-prob the column does not hold.

Shapes: per row, R response tokens; `mask` [R] is 1 on the tokens the policy sampled (multi-turn rows have
observation tokens at 0: they get no teacher term and count in no statistic). k: the teacher's top-k ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# The figures' names in metrics.jsonl, as observe/metric_names.py declares them (DISTILL_*; a unit test keeps the
# two equal): algos/ imports no metric vocabulary, which would tie the math to the dock's Stage names.
REVERSE_KL = "distill/reverse_kl"
TEACHER_LOGPROB = "distill/teacher_logprob"
TOPK_KL = "distill/topk_kl"
TEACHER_TAIL_MASS = "distill/teacher_tail_mass"

# The smallest tail mass either side of top_k_forward_kl takes. A tail is 1 - sum_S p, from fp32 log-probs
# z - lse whose |z|, |lse| are below 2^4 at any sane temperature: each carries an absolute error near
# 2^4 x 2^-24 = 2^-20, i.e. each p a relative one, so sum_S p (at most 1) is known to about 2^-20 and a tail
# below that is rounding. Both tails floored there keep the logs finite (with S the whole vocabulary both
# are 0 up to rounding, and the tail term is then 0 exactly).
TAIL_FLOOR = 2.0**-20


def distill_advantages(teacher: Tensor, student: Tensor, coef: float, mask: Tensor | None = None) -> Tensor:
    """The teacher term of one row's advantages [R] fp32: coef x (teacher - student) on sampled tokens, 0 on
    masked ones. `teacher`, `student`: log-probs of the sampled tokens [R]."""
    if teacher.shape != student.shape:
        raise ValueError(
            f"teacher log-probs {tuple(teacher.shape)} and sampling log-probs {tuple(student.shape)} of a row "
            "differ in length"
        )
    term = coef * (teacher.float() - student.float())
    return term if mask is None else term * mask.float()


def tail_mass(logprobs: Tensor) -> Tensor:
    """1 - sum_S p [...] (fp32, or fp64 for fp64 input) of log-probs [..., k] on a support S, floored at
    TAIL_FLOOR."""
    logprobs = logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
    return (-torch.expm1(torch.logsumexp(logprobs, dim=-1))).clamp(min=TAIL_FLOOR)


def top_k_forward_kl(teacher: Tensor, student: Tensor) -> Tensor:
    """Per-position forward KL [...] (fp32, or fp64 for fp64 input) over the k+1-way distributions of the teacher's top-k (the module
    docstring's KL_k): `teacher`, `student` [..., k] log-probs of the teacher's top-k ids; differentiable
    w.r.t. `student`."""
    if teacher.shape != student.shape:
        raise ValueError(
            f"teacher top-k log-probs {tuple(teacher.shape)} and the student's log-probs of those ids "
            f"{tuple(student.shape)} differ in shape"
        )
    dtype = torch.promote_types(torch.promote_types(teacher.dtype, student.dtype), torch.float32)
    teacher, student = teacher.to(dtype), student.to(dtype)
    support = (teacher.exp() * (teacher - student)).sum(-1)  # [...]
    tail_t, tail_s = tail_mass(teacher), tail_mass(student)  # [...] each
    return support + tail_t * (tail_t.log() - tail_s.log())


@dataclass
class DistillSums:
    """Sums over sampled tokens, for the step's means (summed over workers, then divided)."""

    tokens: float = 0.0
    reverse_kl: float = 0.0  # sum of (student - teacher) log-probs: the per-token reverse KL estimate (k1)
    teacher_logprob: float = 0.0

    def add(self, teacher: Tensor, student: Tensor, mask: Tensor | None = None) -> None:
        """Add one row's tokens (masked ones left out)."""
        weight = torch.ones_like(teacher, dtype=torch.float64) if mask is None else mask.double()
        self.tokens += float(weight.sum())
        self.reverse_kl += float(((student.double() - teacher.double()) * weight).sum())
        self.teacher_logprob += float((teacher.double() * weight).sum())

    def merge(self, other: DistillSums) -> DistillSums:
        return DistillSums(
            self.tokens + other.tokens,
            self.reverse_kl + other.reverse_kl,
            self.teacher_logprob + other.teacher_logprob,
        )

    def means(self) -> dict[str, float]:
        """distill/reverse_kl and distill/teacher_logprob per sampled token ({} without tokens)."""
        if self.tokens == 0:
            return {}
        return {
            REVERSE_KL: self.reverse_kl / self.tokens,
            TEACHER_LOGPROB: self.teacher_logprob / self.tokens,
        }
