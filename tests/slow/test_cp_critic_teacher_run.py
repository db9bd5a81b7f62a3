"""End to end (slow tier): the critic's and the teacher's context parallelism through the CLI, on Ray workers
(7.6 minutes on the 2-core CPU under a load average of 10-17 from other jobs; 2026-12-04).

- PPO's first step with critic.cp=2 (2 critic ranks, one dp rank) against critic.cp=1: the same responses (row
  seeds depend on (run seed, step, row) only), the same values up to fp32 reassociation, so the critic's figures
  and the actor's update on its advantages agree.
- opd with top-k distillation: actor.cp=2 and distill.cp=2 (2 teacher ranks) against cp=1 everywhere: the teacher's
  top-k and the student's support log-probs over split sequences, the same figures.

Bound as in tests/slow/test_cp_run.py: each figure is a sum of a few hundred O(1) fp32 terms in another order,
~1e2 eps_fp32 = 1e-5 relative at most; 1e-4 leaves 10x. The wiring under test beyond
tests/distributed/test_cp_critic_teacher.py: the critic's dp x cp ranks (recipes/cluster.py), the teacher's
(dp, cp, tp) mesh and its cp head talking to the dock, actor.cp accepted with distill.top_k.
"""

import json

import pytest

from dockrl.cli import main
from dockrl.models.tiny import make_tiny

PPO = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 24, groups_per_pull: 2, tp: 1, temperature: 1.0}\n"
    "actor: {lr: 1.0e-3, micro_batch_size: 4}\n"
    "critic: {lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {name: ppo}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "run: {steps: 1, prompts_per_step: 2, progress: false, worker_timeout_s: 300, precision: fp32}\n"
)
OPD = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 24, groups_per_pull: 2, tp: 1, temperature: 1.0}\n"
    "actor: {lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {name: opd}\n"
    "distill: {coef: 0.5, top_k: 8, micro_batch_size: 4}\n"
    "run: {steps: 1, prompts_per_step: 2, progress: false, worker_timeout_s: 300, precision: fp32}\n"
)
PPO_COMPARED = (
    "critic/value_loss",
    "critic/grad_norm",
    "critic/values_mean",
    "critic/explained_variance",
    "actor/loss",
    "actor/grad_norm",
)
OPD_COMPARED = ("distill/topk_kl", "distill/teacher_tail_mass", "actor/loss", "actor/grad_norm")


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    """A different tiny model with the policy's tokenizer (make_tiny's tokenizer does not depend on the seed)."""
    return make_tiny(
        tmp_path_factory.mktemp("teacher") / "model", family="qwen2", hidden_size=64, num_layers=2, seed=7
    )


def _first_step(tmp_path, name: str, config: str, overrides: list[str]) -> dict:
    path = tmp_path / f"{name}.yaml"
    path.write_text(config)
    code = main(["train", str(path), f"run.output_dir={tmp_path}", f"run.name={name}", *overrides])
    assert code == 0
    return json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])


def _assert_same(cp: dict, single: dict, keys: tuple[str, ...], near_zero: tuple[str, ...] = ()) -> None:
    """Each figure within 1e-4 relative (module docstring); a figure in `near_zero` is a cancelling sum of O(1)
    terms, which keeps their absolute error instead: ~1e2 x eps_fp32 = 1.2e-5, 1e-4 absolute leaves 8x."""
    for key in keys:
        bound = 1e-4 if key in near_zero else 1e-7
        assert cp[key] == pytest.approx(single[key], rel=1e-4, abs=bound), (key, cp[key], single[key])


def test_critic_cp2_first_step_equals_cp1(ray_session, tmp_path, tiny_model, arithmetic_data):
    base = [f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}"]
    single = _first_step(tmp_path, "critic-cp1", PPO, base)
    split = _first_step(tmp_path, "critic-cp2", PPO, [*base, "critic.cp=2"])
    assert single["critic/grad_norm"] > 0 and single["critic/value_loss"] > 0
    # The actor's first-step loss is -mean(A) over its tokens, ~0 (the advantages whitened), from GAE over the
    # critic's values, which carry the critic's reassociation error: an absolute bound (2e-7 against 7e-8 on an
    # Intel AMX host, where 1e-7 failed)
    _assert_same(split, single, PPO_COMPARED, near_zero=("actor/loss",))


def test_top_k_distillation_with_cp2_student_and_teacher_equals_cp1(
    ray_session, tmp_path, tiny_model, teacher_model, arithmetic_data
):
    base = [f"model.path={tiny_model}", f"data.train_path={arithmetic_data['train']}"]
    base += [f"distill.teacher_path={teacher_model}"]
    single = _first_step(tmp_path, "opd-cp1", OPD, base)
    split = _first_step(
        tmp_path, "opd-cp2", OPD, [*base, "actor.cp=2", "distill.cp=2", "distill.num_workers=2"]
    )
    assert single["distill/topk_kl"] > 0 and single["actor/grad_norm"] > 0
    _assert_same(split, single, OPD_COMPARED)
