"""On-policy distillation: the teacher term of the advantages against hand-computed numbers, the reward stage
that adds it (opd alone, beside GRPO's group advantages, multi-turn masks), the config checks (the vocabulary
check names both paths, before Ray), and opd through the CLI with LoRA, a teacher sharded over two ranks and
asynchronous separate rollout, resumed from a checkpoint with a step in flight."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from dockrl.algos.distill import DistillSums, distill_advantages
from dockrl.algos.estimators import compute_advantages
from dockrl.algos.losses import policy_loss
from dockrl.cli import main
from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.config.schema import AlgoConfig, RewardConfig
from dockrl.config.specs import RewardStageSpec
from dockrl.config.step_plan import loss_plan
from dockrl.dock.columns import TEACHER_LOGPROBS
from dockrl.engines.train.policy_update import importance_weights
from dockrl.models.tiny import make_tiny
from dockrl.models.tokenizer import Tokenizer
from dockrl.recipes.preflight import preflight_train
from dockrl.workers.reward import RewardWorker
from helpers import FakeDock

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_teacher_term_is_coef_times_teacher_minus_sampling_logprob():
    teacher = torch.tensor([-0.5, -2.0, -1.0, -3.25])
    student = torch.tensor([-1.0, -1.5, -1.0, -0.25])
    assert distill_advantages(teacher, student, 0.5).tolist() == [0.25, -0.25, 0.0, -1.5]
    masked = distill_advantages(teacher, student, 1.0, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert masked.tolist() == [0.5, 0.0, 0.0, -3.0]
    sums = DistillSums()
    sums.add(teacher, student, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    # tokens 0, 2, 3: reverse KL (student - teacher) -0.5, 0, 3; teacher log-probs -0.5, -1, -3.25
    assert sums.means() == {"distill/reverse_kl": 2.5 / 3, "distill/teacher_logprob": -4.75 / 3}
    assert DistillSums().means() == {}
    with pytest.raises(ValueError, match="differ in length"):
        distill_advantages(teacher, student[:3], 1.0)


def test_stale_teacher_terms_are_weighted_only_with_algo_rollout_is():
    """One update per step (the default): the update's old log-probs are its current ones, so the PPO ratio is 1
    and rows sampled by older weights (asynchronous rollout) train uncorrected unless algo.rollout_is is set;
    then each token's teacher term is weighed by min(pi_current / pi_rollout, cap). By hand, coef 0.5, stale
    rollout log-probs against the current ones (w = exp(current - rollout) = [0.5, 1, 3 -> cap 2, 1.5]):
        A = 0.5 x (teacher - rollout) = [0.25, -0.25, 0.0, -1.5]
        uncorrected: -mean(A)     = -(0.25 - 0.25 + 0 - 1.5) / 4        =  0.375 (= 0.5 x reverse KL)
        tis:         -mean(w x A) = -(0.125 - 0.25 + 0 - 2.25) / 4      =  0.59375"""
    teacher = torch.tensor([-0.5, -2.0, -1.0, -3.25])
    rollout = torch.tensor([-1.0, -1.5, -1.0, -0.25])
    current = rollout + torch.log(torch.tensor([0.5, 1.0, 3.0, 1.5]))
    advantages = distill_advantages(teacher, rollout, 0.5)[None]  # [1, 4]
    mask = torch.ones(1, 4)
    losses = {}
    for correction in ("none", "tis"):
        algo = AlgoConfig(name="opd", rollout_is=correction, rollout_is_cap=2.0)
        plan = loss_plan(algo, 4)
        raw = (current - rollout).exp()[None]
        weights = None if correction == "none" else importance_weights(raw, plan)
        out = policy_loss(
            current[None], current[None], advantages, mask, plan, num_tokens=4.0, is_weights=weights
        )
        losses[correction] = float(out.pg_loss)
    # fp32 token-means of 4 terms |w A| <= 3: rounding < 4 x 3 x 2**-24 < 1e-6
    assert losses["none"] == pytest.approx(0.375, abs=1e-6)
    sums = DistillSums()
    sums.add(teacher, rollout)
    assert losses["none"] == pytest.approx(0.5 * sums.means()["distill/reverse_kl"], abs=1e-6)
    assert losses["tis"] == pytest.approx(0.59375, abs=1e-6)


def _rows(tokenizer: Tokenizer) -> dict[str, list]:
    """Two groups of two rows (one right answer each) with rollout and teacher log-probs per response token."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is 3+4?", "What is 9-5?")
    ]
    responses = ["7<|im_end|>", "5<|im_end|>", "3<|im_end|>", "4<|im_end|>"]
    response_ids = [torch.tensor(tokenizer.encode(r)) for r in responses]
    lengths = [len(r) for r in response_ids]
    return {
        "prompt_ids": [torch.tensor(tokenizer.encode(prompts[i // 2])) for i in range(4)],
        "response_ids": response_ids,
        "label": ["7", "7", "4", "4"],
        "policy_version": [torch.zeros(n, dtype=torch.int64) for n in lengths],
        "rollout_logprobs": [
            -torch.arange(1, n + 1, dtype=torch.float32) / (i + 2) for i, n in enumerate(lengths)
        ],
        TEACHER_LOGPROBS: [-torch.full((n,), 0.75 * (i + 1)) for i, n in enumerate(lengths)],
    }


@pytest.mark.parametrize("estimator, coef", [("none", 1.0), ("grpo", 0.5)])
def test_reward_stage_adds_the_teacher_term_to_each_token(estimator, coef, tiny_model):
    """opd (estimator none): each token's advantage is exactly teacher - rollout log-prob; grpo with
    distill.coef=0.5: the group advantage broadcast over the row plus half of it."""
    columns = _rows(Tokenizer.from_dir(tiny_model))
    dock = FakeDock(columns, group_size=2)
    reward = RewardConfig(num_processes=0, groups_per_pull=2)
    algo = AlgoConfig(name="opd" if estimator == "none" else "grpo")
    worker = RewardWorker(
        "reward-0",
        0,
        1,
        spec=RewardStageSpec(
            reward=reward,
            algo=algo,
            estimator=estimator,
            tokenizer_path=str(tiny_model),
            group_size=2,
            distill_coef=coef,
        ),
        client=dock,
    )
    out = worker.score()
    assert out.rewards == [1.0, 0.0, 0.0, 1.0]  # exact_answer still scores (train/accuracy)
    group = compute_advantages(estimator, torch.tensor(out.rewards), 2, eps=algo.adv_eps).tolist()
    if estimator == "none":
        assert group == [0.0] * 4
    for i, row in enumerate(dock.table):
        teacher, student = row[TEACHER_LOGPROBS], row["rollout_logprobs"]
        expected = [group[i] + coef * (t - s) for t, s in zip(teacher.tolist(), student.tolist())]
        assert row["advantages"].tolist() == pytest.approx(expected, abs=1e-6)
    worker.close()


def test_multi_turn_observation_tokens_get_no_teacher_term(tiny_model):
    columns = _rows(Tokenizer.from_dir(tiny_model))
    masks = [torch.ones(len(r)) for r in columns["response_ids"]]
    for mask in masks:
        mask[0] = 0.0  # the first token of each response stands for an observation
    columns.update(loss_mask=masks, env_reward=[float("nan")] * 4, env_failed=[0.0] * 4)
    dock = FakeDock(columns, group_size=2)
    worker = RewardWorker(
        "reward-0",
        0,
        1,
        spec=RewardStageSpec(
            reward=RewardConfig(num_processes=0, groups_per_pull=2),
            algo=AlgoConfig(name="opd"),
            estimator="none",
            tokenizer_path=str(tiny_model),
            group_size=2,
            env_weight=1.0,
            distill_coef=1.0,
        ),
        client=dock,
    )
    worker.score()
    for row in dock.table:
        expected = (row[TEACHER_LOGPROBS] - row["rollout_logprobs"]) * row["loss_mask"]
        assert row["advantages"][0].item() == 0.0
        assert torch.equal(row["advantages"], expected)
    worker.close()


# ---------------------------------------------------------------- settings


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    """A different tiny model with the policy's tokenizer (make_tiny's tokenizer does not depend on the seed)."""
    return make_tiny(
        tmp_path_factory.mktemp("teacher") / "model", family="qwen2", hidden_size=64, num_layers=2, seed=7
    )


def _overrides(tiny_model, arithmetic_data, *extra: str) -> list[str]:
    return [
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        "run.steps=1",
        "run.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        *extra,
    ]


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory):
    return make_tiny(
        tmp_path_factory.mktemp("other_vocab") / "model",
        corpus=["What is 1+2? 3 4 5 6 7 8 9 0"] * 20,
        vocab_size=300,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
    )


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["algo.name=opd"], r"algo.name='?opd'?: trains on the teacher's.*distill.teacher_path is unset"),
        (["algo.adv_estimator=none"], r"algo.adv_estimator='?none'?: .*set distill.teacher_path"),
        (["distill.teacher_path=TEACHER", "distill.coef=-1"], r"distill.coef=-1.*must be finite and >= 0"),
        (
            ["distill.teacher_path=TEACHER", "distill.tp=2"],
            r"distill.tp=2: does not divide distill.num_workers=1",
        ),
        (["distill.teacher_path=TEACHER", "algo.name=ppo"], r"distill.teacher_path=.*ppo's advantages come"),
        (
            ["distill.teacher_path=TEACHER", "algo.name=opd", "algo.dynamic_sampling=true"],
            r"algo.dynamic_sampling=True: .*algo.name=opd does not train on rewards",
        ),
        (["distill.teacher_path=MISSING"], r"distill.teacher_path=.*the model directory does not exist"),
    ],
)
def test_bad_distill_settings_are_errors(
    extra, expected, tmp_path, tiny_model, teacher_model, arithmetic_data
):
    extra = [e.replace("TEACHER", str(teacher_model)).replace("MISSING", str(tmp_path / "no")) for e in extra]
    cfg = load_config(TrainConfig, None, _overrides(tiny_model, arithmetic_data, *extra))
    with pytest.raises(ConfigError, match=expected):
        preflight_train(cfg)


def test_a_teacher_with_another_vocabulary_is_refused_before_ray(
    monkeypatch, capsys, tiny_model, other_vocabulary, arithmetic_data
):
    import dockrl.recipes.grpo as grpo

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started before the config was validated")

    monkeypatch.setattr(grpo, "init_ray", forbidden)
    overrides = _overrides(tiny_model, arithmetic_data, f"distill.teacher_path={other_vocabulary}")
    assert main(["train", str(EXAMPLES / "opd_tiny.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert (
        f"distill.teacher_path={other_vocabulary}" in err
        or f"distill.teacher_path='{other_vocabulary}'" in err
    )
    assert f"model.path={tiny_model}" in err and "other ids than the policy's" in err


def test_example_validates_and_settings_without_a_teacher_warn(tiny_model, teacher_model, arithmetic_data):
    overrides = _overrides(tiny_model, arithmetic_data, f"distill.teacher_path={teacher_model}")
    cfg = load_config(TrainConfig, EXAMPLES / "opd_tiny.yaml", overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = preflight_train(cfg)
    plan = resolved.plan
    assert plan.estimator == "none" and plan.advantages_by == "reward" and not plan.reference
    cfg = load_config(TrainConfig, None, _overrides(tiny_model, arithmetic_data, "distill.coef=0.5"))
    with pytest.warns(UserWarning, match="no effect without distill.teacher_path"):
        preflight_train(cfg)


# ---------------------------------------------------------------- through the CLI


def test_multi_turn_samples_show_the_whole_trajectory(tiny_model, tmp_path):
    """samples.jsonl's multi-turn rows: every turn in order (the policy's and the observations, split by
    loss_mask), each decoded with its token count, the reward components; `dockrl report` shows each turn."""
    from dockrl.observe.report import write_report

    tokenizer = Tokenizer.from_dir(tiny_model)
    columns = _rows(tokenizer)
    turn, observation = tokenizer.encode("call"), tokenizer.encode(" result 7\n")
    final = columns["response_ids"]
    columns["response_ids"] = [torch.tensor(turn + observation + r.tolist()) for r in final]
    columns["loss_mask"] = [
        torch.tensor([1.0] * len(turn) + [0.0] * len(observation) + [1.0] * len(r)) for r in final
    ]
    columns.update(env_reward=[1.0, 0.0, 0.5, float("nan")], env_failed=[0.0] * 4)
    dock = FakeDock(columns, group_size=2)
    worker = RewardWorker(
        "reward-0",
        0,
        1,
        spec=RewardStageSpec(
            reward=RewardConfig(num_processes=0, groups_per_pull=2),
            algo=AlgoConfig(),
            estimator="grpo",
            tokenizer_path=str(tiny_model),
            group_size=2,
            log_samples=2,
            env_weight=1.0,
        ),
        client=dock,
    )
    sample = worker.score().samples[0]
    worker.close()
    assert [t["role"] for t in sample["turns"]] == ["assistant", "observation", "assistant"]
    assert [t["tokens"] for t in sample["turns"]] == [len(turn), len(observation), len(final[0])]
    assert sample["turns"][1]["text"] == tokenizer.decode(observation, skip_special_tokens=False)
    assert sample["response"] == "7" and sample["components"]["env"] == 1.0
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 1.0}\n')
    (run / "samples.jsonl").write_text(json.dumps({"step": 1, **sample}) + "\n")
    write_report([run], tmp_path / "out")
    page = (tmp_path / "out" / "report.html").read_text()
    assert page.count("<b>assistant</b>") == 2 and page.count("<b>observation</b>") == 1
