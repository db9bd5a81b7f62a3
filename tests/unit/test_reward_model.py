"""Reward models: the score head matches transformers' *ForSequenceClassification, make-tiny builds one, the
RewardModelWorker scores whole groups from the dock, the RewardWorker adds weight x rm_score to the rule rewards,
bad settings fail before Ray, and two GRPO steps with a reward model run through the CLI."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
    Qwen3Config,
    Qwen3ForSequenceClassification,
)

from dockrl.algos.estimators import compute_advantages
from dockrl.cli import main
from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.config.schema import AlgoConfig, RewardConfig, RewardFnConfig, RewardModelConfig
from dockrl.config.specs import RewardModelSpec, RewardStageSpec
from dockrl.models.classifier import (
    RewardModel,
    check_reward_model_dir,
    load_reward_model,
    save_reward_model,
)
from dockrl.models.config import ModelArgs
from dockrl.models.hf import load_state_dict
from dockrl.models.tiny import make_tiny
from dockrl.models.tokenizer import Tokenizer, same_vocabulary
from dockrl.recipes.dynamic_sampling import group_rewards, select_groups
from dockrl.recipes.preflight import preflight_train
from dockrl.workers.reward import RewardWorker
from dockrl.workers.reward_model import RM_SCORE, RewardModelWorker, rm_token_ids
from helpers import FakeDock, perturb_

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOCAB = 96
PAD = 0
_HF_CLASSES = {
    "llama": (LlamaConfig, LlamaForSequenceClassification),
    "qwen2": (Qwen2Config, Qwen2ForSequenceClassification),
    "qwen3": (Qwen3Config, Qwen3ForSequenceClassification),
}


def _hf_reward_model(family: str, num_labels: int = 1) -> torch.nn.Module:
    config_cls, model_cls = _HF_CLASSES[family]
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
        num_labels=num_labels,
    )
    if family == "qwen3":
        kwargs["head_dim"] = 16  # != hidden / heads, as in real Qwen3 checkpoints
    if family == "llama":
        kwargs["attention_bias"] = True
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs))
    perturb_(model, seed=1)
    return model.eval()


def _sequences() -> list[list[int]]:
    """Uneven lengths; one ends in pad-token ids (pooled before them), one has a pad id inside."""
    generator = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (17, 5, 30, 11)]
    seqs[1] += [PAD, PAD]
    seqs[3][4] = PAD
    return seqs


def _right_padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), PAD)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_score_head_matches_transformers(family, tmp_path):
    hf_model = _hf_reward_model(family)
    hf_model.save_pretrained(tmp_path)
    model = load_reward_model(tmp_path)
    assert model.args.family == family and model.score.weight.shape == (1, 32)
    seqs = _sequences()
    ids, mask = _right_padded(seqs)
    expected = hf_model(input_ids=ids, attention_mask=mask).logits[:, 0]  # [B]
    alone = torch.cat([hf_model(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
    assert (expected - alone).abs().max().item() <= 1e-4  # transformers itself: padding changes nothing
    assert (model(ids, mask.bool())[:, 0] - expected).abs().max().item() <= 1e-4
    for micro_batch_size in (1, 3):
        scores = torch.tensor(model.score_sequences(seqs, micro_batch_size))
        assert (scores - expected).abs().max().item() <= 1e-4
    # The pooled token matters: scoring the sequence ending in pad ids at its very last token differs.
    last = hf_model.score(hf_model.model(input_ids=torch.tensor([seqs[1]])).last_hidden_state[:, -1])
    assert (last[0, 0] - expected[1]).abs().item() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_saved_reward_model_loads_in_transformers(family, tmp_path):
    args = ModelArgs(
        family=family,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=family == "qwen2",
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        pad_token_id=PAD,
    )
    model = RewardModel(args)
    model.init_weights(seed=0)
    perturb_(model, seed=2)
    save_reward_model(model, tmp_path)
    hf_model = AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf_model) is _HF_CLASSES[family][1] and hf_model.config.num_labels == 1
    ids, mask = _right_padded(_sequences())
    expected = hf_model(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert (model(ids, mask.bool())[:, 0] - expected).abs().max().item() <= 1e-4
    reloaded = load_reward_model(tmp_path)
    assert torch.equal(reloaded(ids, mask.bool()), model(ids, mask.bool()))


# ---------------------------------------------------------------- make-tiny, worker, reward combination


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory):
    """A tiny qwen2-family reward model made by the CLI, the size of the `tiny_model` policy."""
    out = tmp_path_factory.mktemp("tiny_rm") / "rm"
    assert main(["make-tiny", str(out), "--reward-model", "--seed", "1"]) == 0
    return out


@torch.no_grad()
def test_make_tiny_reward_model_loads_in_transformers(tiny_reward_model, tiny_model):
    args = check_reward_model_dir(tiny_reward_model)
    config = json.loads((tiny_reward_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert args.hidden_size == 64 and args.num_layers == 2
    stored = load_state_dict(tiny_reward_model)
    assert stored["score.weight"].shape == (1, 64) and "lm_head.weight" not in stored
    hf_model = AutoModelForSequenceClassification.from_pretrained(
        tiny_reward_model, dtype=torch.float32
    ).eval()
    tokenizer = Tokenizer.from_dir(tiny_reward_model)
    seqs = [tokenizer.encode(t) for t in ("What is 3+4? 7", "What is 12-5?<|im_end|>", "9")]
    expected = torch.cat([hf_model(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
    scores = torch.tensor(load_reward_model(tiny_reward_model).score_sequences(seqs, 2))
    assert (scores - expected).abs().max().item() <= 1e-4
    assert scores.std().item() > 0  # random weights, not a constant head
    # Same tokenizer as the policy of the same command, so the dock's ids go in unchanged.
    assert same_vocabulary(tiny_model, tiny_reward_model)


def _group_rows(tokenizer: Tokenizer) -> dict[str, list]:
    """Two groups of two rows: chat prompts, short responses (one right, one wrong answer each), labels."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("What is 3+4?", "What is 9-5?")
    ]
    responses = ["7<|im_end|>", "5<|im_end|>", "3<|im_end|>", "4<|im_end|>"]
    return {
        "prompt_ids": [torch.tensor(tokenizer.encode(prompts[i // 2])) for i in range(4)],
        "response_ids": [torch.tensor(tokenizer.encode(r)) for r in responses],
        "label": ["7", "7", "4", "4"],
        "policy_version": [torch.zeros(len(tokenizer.encode(r)), dtype=torch.int64) for r in responses],
    }


def test_reward_model_worker_scores_whole_groups(tiny_reward_model, tiny_model):
    dock = FakeDock(_group_rows(Tokenizer.from_dir(tiny_model)), group_size=2)
    worker = RewardModelWorker(
        "reward_model-0",
        0,
        1,
        spec=RewardModelSpec(
            reward_model=RewardModelConfig(path=str(tiny_reward_model), micro_batch_size=3),
            policy_path=str(tiny_model),
            group_size=2,
            groups_per_pull=1,
            device="cpu",
            precision="fp32",
        ),
        client=dock,
    )
    assert worker.rm_tokenizer is None  # same vocabulary: ids pass through
    out = worker.score()
    assert [rows for _, rows in dock.pulls] == [[0, 1], [2, 3]]  # whole groups, one per pull
    sequences = [torch.cat([r["prompt_ids"], r["response_ids"]]).tolist() for r in dock.table]
    expected = load_reward_model(tiny_reward_model).score_sequences(sequences, 1)
    assert [r[RM_SCORE] for r in dock.table] == pytest.approx(expected, abs=1e-5)
    assert out.scores == pytest.approx(expected, abs=1e-5)
    assert len(set(out.scores)) == 4


def test_reward_model_with_another_vocabulary_reads_the_same_text(tmp_path, tiny_reward_model, tiny_model):
    small = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    policy_dir = make_tiny(
        tmp_path / "policy", corpus=["What is 1+2? 3 4 5 6 7 8 9 0"] * 20, vocab_size=300, **small
    )
    assert not same_vocabulary(policy_dir, tiny_reward_model)
    policy, rm = Tokenizer.from_dir(policy_dir), Tokenizer.from_dir(tiny_reward_model)
    text = policy.apply_chat_template([{"role": "user", "content": "What is 3+4?"}]) + "7<|im_end|>"
    prompt_ids, response_ids = (
        torch.tensor(policy.encode(text[:-11])),
        torch.tensor(policy.encode(text[-11:])),
    )
    ids = rm_token_ids(prompt_ids, response_ids, policy, rm)
    assert ids == rm.encode(text) and rm.decode(ids, skip_special_tokens=False) == text
    assert ids != prompt_ids.tolist() + response_ids.tolist()
    assert rm_token_ids(prompt_ids, response_ids, policy, None) == prompt_ids.tolist() + response_ids.tolist()


@pytest.mark.parametrize("functions", [[RewardFnConfig(name="exact_answer", weight=2.0)], []])
def test_reward_worker_adds_weighted_model_score(functions, tiny_model, tiny_reward_model):
    columns = _group_rows(Tokenizer.from_dir(tiny_model))
    columns[RM_SCORE] = [0.5, -0.25, 1.0, 2.0]
    dock = FakeDock(columns, group_size=2)
    reward = RewardConfig(
        functions=functions,
        model=RewardModelConfig(path=str(tiny_reward_model), weight=0.5),
        num_processes=0,
        groups_per_pull=2,
    )
    algo = AlgoConfig()
    worker = RewardWorker(
        "reward-0",
        0,
        1,
        spec=RewardStageSpec(
            reward=reward,
            algo=algo,
            estimator="grpo",
            tokenizer_path=str(tiny_model),
            group_size=2,
        ),
        client=dock,
    )
    out = worker.score()
    rule = [2.0, 0.0, 0.0, 2.0] if functions else [0.0] * 4  # "7" right for 3+4, "4" right for 9-5
    total = [r + 0.5 * s for r, s in zip(rule, columns[RM_SCORE])]
    assert [row["reward"] for row in dock.table] == pytest.approx(total)
    assert [row["reward/rm"] for row in dock.table] == columns[RM_SCORE]
    assert out.rewards == pytest.approx(total) and out.rm == columns[RM_SCORE]
    adv = compute_advantages("grpo", torch.tensor(total), 2, eps=algo.adv_eps, normalize_std=True)
    for row, a in zip(dock.table, adv.tolist()):
        assert torch.allclose(row["advantages"], torch.full((len(row["response_ids"]),), a))
    assert ("reward/exact_answer" in dock.table[0]) == bool(functions)
    assert out.correct == ([1.0, 0.0, 0.0, 1.0] if functions else [])
    worker.close()


def test_dynamic_sampling_reads_correctness_before_shaping_and_the_update_weights(tiny_model):
    """DAPO keeps a group when some but not all answers are correct. Rows 0-1 both answer 3+4 wrong ("6", "5")
    with responses of different lengths, so the overlong penalty spreads their totals; rows 2-3 answer 9-5 one
    right, one wrong. ScoreResult.accuracy is exact_answer/correct, the filter's input: only group 2 is
    informative (filtering on the totals kept both)."""
    tokenizer = Tokenizer.from_dir(tiny_model)
    columns = _group_rows(tokenizer)
    columns["response_ids"][0] = torch.tensor(tokenizer.encode("6<|im_end|>"))
    columns["response_ids"][1] = torch.tensor(tokenizer.encode("my answer is 5<|im_end|>"))
    lengths = [len(r) for r in columns["response_ids"]]
    assert lengths[1] > lengths[0] + 1 and lengths[0] <= 2  # only row 1 is inside the overlong buffer
    dock = FakeDock(columns, group_size=2)
    reward = RewardConfig(functions=[RewardFnConfig(name="exact_answer")], num_processes=0)
    algo = AlgoConfig(overlong_buffer_len=lengths[1] - 2, overlong_penalty=1.0)
    worker = RewardWorker(
        "reward-0",
        0,
        1,
        spec=RewardStageSpec(
            reward=reward,
            algo=algo,
            estimator="grpo",
            tokenizer_path=str(tiny_model),
            group_size=2,
            max_new_tokens=lengths[1],
        ),
        client=dock,
    )
    out = worker.score()
    worker.close()
    assert out.rewards[0] == 0.0 and out.rewards[1] == -1.0  # all wrong, but the totals differ
    assert out.accuracy == [0.0, 0.0, 0.0, 1.0] and out.weights == [1.0] * 4
    assert select_groups(group_rewards(out.rows, out.rewards, 2), 2, fill=False).keep == [0, 2]
    assert select_groups(group_rewards(out.rows, out.accuracy, 2, out.weights), 2, fill=False).keep == [2]


# ---------------------------------------------------------------- config errors before Ray


def _overrides(tiny_model, arithmetic_data, *extra: str) -> list[str]:
    return [
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        "run.steps=1",
        "run.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        *extra,
    ]


def test_example_validates_without_warnings(tiny_model, tiny_reward_model, arithmetic_data):
    overrides = _overrides(tiny_model, arithmetic_data, f"reward.model.path={tiny_reward_model}")
    cfg = load_config(TrainConfig, EXAMPLES / "grpo_reward_model_tiny.yaml", overrides)
    assert cfg.reward.model.weight == 0.5 and [f.name for f in cfg.reward.functions] == ["exact_answer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight_train(cfg)
        # A reward model alone (no rule reward) is a valid config too.
        preflight_train(load_config(TrainConfig, None, overrides + ["reward.functions=[]"]))


@pytest.fixture(scope="module")
def bad_reward_models(tmp_path_factory):
    """Checkpoints that are not usable reward models: two outputs, and one without tokenizer files."""
    root = tmp_path_factory.mktemp("bad_rm")
    _hf_reward_model("qwen2", num_labels=2).save_pretrained(root / "two_labels")
    _hf_reward_model("llama").save_pretrained(root / "no_tokenizer")
    return root


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", r"reward.model.path='.*missing': the model directory does not exist"),
        (
            "causal_lm",
            r"reward.model.path=.*is not a sequence-classification model.*Qwen2ForSequenceClassification",
        ),
        ("two_labels", r"reward.model.path=.*num_labels=2.*use a checkpoint saved with num_labels=1"),
        ("no_tokenizer", r"reward.model.path=.*no tokenizer.json.*copy the reward model's tokenizer"),
        (
            "no_reward",
            r"reward.functions=\[\]: no reward function and no reward model.*set reward.model.path",
        ),
        ("eval_without_rules", r"data.eval_path=.*reward.functions is empty.*unset data.eval_path"),
        ("micro_batch", r"reward.model.micro_batch_size=0: must be >= 1"),
    ],
)
def test_bad_reward_model_settings_are_errors(
    case, expected, tmp_path, tiny_model, tiny_reward_model, arithmetic_data, bad_reward_models
):
    path = {
        "missing": tmp_path / "missing",
        "causal_lm": tiny_model,
        "two_labels": bad_reward_models / "two_labels",
        "no_tokenizer": bad_reward_models / "no_tokenizer",
    }.get(case, tiny_reward_model)
    extra = {
        "no_reward": ["reward.functions=[]", "reward.model.path=null"],
        "eval_without_rules": ["reward.functions=[]", f"data.eval_path={arithmetic_data['test']}"],
        "micro_batch": ["reward.model.micro_batch_size=0"],
    }.get(case, [])
    cfg = load_config(
        TrainConfig, None, _overrides(tiny_model, arithmetic_data, f"reward.model.path={path}", *extra)
    )
    with pytest.raises(ConfigError, match=expected):
        preflight_train(cfg)


def test_reward_model_settings_without_a_path_warn(tiny_model, arithmetic_data):
    cfg = load_config(TrainConfig, None, _overrides(tiny_model, arithmetic_data, "reward.model.weight=0.5"))
    with pytest.warns(UserWarning, match="no effect without reward.model.path"):
        preflight_train(cfg)


def test_cli_rejects_a_causal_lm_as_reward_model_before_ray(monkeypatch, capsys, tiny_model, arithmetic_data):
    import dockrl.recipes.grpo as grpo

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started before the config was validated")

    monkeypatch.setattr(grpo, "init_ray", forbidden)
    overrides = _overrides(tiny_model, arithmetic_data, f"reward.model.path={tiny_model}")
    code = main(["train", str(EXAMPLES / "grpo_reward_model_tiny.yaml"), *overrides])
    assert code == 2
    assert "is not a sequence-classification model" in capsys.readouterr().err


# ---------------------------------------------------------------- two GRPO steps through the CLI


@pytest.mark.parametrize("on_error, weights", [("drop_group", [1.0, 1.0, 0.0, 0.0]), ("zero", [1.0] * 4)])
def test_a_failed_reward_call_leaves_its_group_out_of_the_update(on_error, weights, tiny_model):
    # rows 0-1 answer 3+4, rows 2-3 answer 9-5; the call on row 2 ("3") raises
    dock = FakeDock(_group_rows(Tokenizer.from_dir(tiny_model)), group_size=2)
    reward = RewardConfig(
        functions=[RewardFnConfig(name="reward_fixtures:fails_on_three")], num_processes=0, on_error=on_error
    )
    worker = RewardWorker(
        "reward-0",
        0,
        1,
        spec=RewardStageSpec(
            reward=reward,
            algo=AlgoConfig(),
            estimator="grpo",
            tokenizer_path=str(tiny_model),
            group_size=2,
        ),
        client=dock,
    )
    out = worker.score()
    assert [row["update_weight"] for row in dock.table] == weights
    assert out.weights == weights  # what dynamic sampling reads to leave a dropped group uninformative
    assert out.errors == 1 and out.dropped_groups == (1 if on_error == "drop_group" else 0)
    assert out.rewards == [1.0, 1.0, 0.0, 1.0]  # the failed call scores 0 in the reward either way
    worker.close()
