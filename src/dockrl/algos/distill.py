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

Shapes: per row, R response tokens; `mask` [R] is 1 on the tokens the policy sampled (multi-turn rows have
observation tokens at 0: they get no teacher term and count in no statistic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# The figures' names in metrics.jsonl, as observe/metric_names.py declares them (DISTILL_*; a unit test keeps the
# two equal): algos/ imports no metric vocabulary, which would tie the math to the dock's Stage names.
REVERSE_KL = "distill/reverse_kl"
TEACHER_LOGPROB = "distill/teacher_logprob"


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
