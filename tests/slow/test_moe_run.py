"""GRPO on a tiny Qwen3-MoE through the CLI and the dock, with expert parallelism (ep=2) and routing replay
(r3): the rollout's experts travel in routed_experts, the trainer replays them while its experts live on two
ranks, and the run's checkpoint exports per-expert files that load back and resumes step 3 bit for bit; config
errors before Ray. Replay is seen to happen: a reference whose routers send every token elsewhere computes the
policy's log-probs with the rollout's experts replayed, and others without."""

import json
import math
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dockrl.cli import main
from dockrl.config import ConfigError, TrainConfig, load_config
from dockrl.models.hf import load_model
from dockrl.recipes.preflight import preflight_train
from runs import computed_metrics, metric_differences

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2}\n"
    "actor: {dp: 2, ep: 2, lr: 1.0e-3, micro_batch_size: 4}\n"
    "algo: {kl_coef: 0.01, routing_replay: r3}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "run: {steps: 3, save_every: 2, prompts_per_step: 4, progress: false, worker_timeout_s: 300, precision: fp32}\n"
)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from dockrl.models.tiny import make_tiny

    return make_tiny(
        tmp_path_factory.mktemp("moe") / "model", family="qwen3_moe", hidden_size=64, num_layers=2
    )


@pytest.fixture(scope="module")
def top1_moe(tmp_path_factory):
    """A top-1 Qwen3-MoE (norm_topk_prob: the chosen expert's weight is p / p = 1, whatever the router says) and
    its reference: the same files with each router's rows rotated (expert e's row moves to e + 1), so the
    reference's router sends every token to the expert after the policy's, and nothing else differs."""
    from dockrl.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("top1")
    policy = make_tiny(
        root / "policy", family="qwen3_moe", hidden_size=64, num_layers=2, num_experts_per_tok=1
    )
    reference = root / "reference"
    shutil.copytree(policy, reference)
    weights = load_file(reference / "model.safetensors")
    routers = [name for name in weights if name.endswith("mlp.gate.weight")]
    assert len(routers) == 2  # the layout this fixture relies on: one router per layer
    for name in routers:
        weights[name] = weights[name].roll(1, dims=0)  # [E, H]: logit of e+1 := the policy's logit of e
    save_file(weights, reference / "model.safetensors", metadata={"format": "pt"})
    return policy, reference


# The reference pass with the rollout's experts replayed computes what the update's forward computes at step 1 (the
# same experts, weight 1, the same weights elsewhere): they differ by fp32 rounding, bounded by the rollout-trainer
# log-prob bound below (1e-5), so the k2 estimator 0.5 d^2 stays under 0.5e-10 on every token.
REPLAYED_KL_BOUND = 0.5 * 1e-5**2


@pytest.mark.parametrize("replay", ["r3", "none"])
def test_replay_makes_the_reference_compute_the_rollouts_experts(
    ray_session, tmp_path, top1_moe, arithmetic_data, replay
):
    """Step 1 with the rotated-router reference (model.ref_path): with replay its log-probs are the policy's
    (actor/kl at rounding); without replay (the check seen failing) the reference routes every token to another
    expert and the KL is far above the bound."""
    policy, reference = top1_moe
    config = tmp_path / "moe.yaml"
    config.write_text(CONFIG)
    args = ["train", str(config), f"model.path={policy}", f"model.ref_path={reference}"]
    args += [f"data.train_path={arithmetic_data['train']}", "algo.kl_estimator=k2", "run.steps=1"]
    args += [f"algo.routing_replay={replay}", f"run.output_dir={tmp_path}", "run.name=replay"]
    assert main(args) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/logprob_abs_diff"] < 1e-5
    if replay == "r3":
        assert row["actor/kl"] < REPLAYED_KL_BOUND
    else:
        assert row["actor/kl"] > REPLAYED_KL_BOUND


def test_grpo_with_routing_replay_through_cli(ray_session, tmp_path, moe_model, arithmetic_data):
    config = tmp_path / "moe.yaml"
    config.write_text(CONFIG)
    args = ["train", str(config), f"model.path={moe_model}", f"data.train_path={arithmetic_data['train']}"]
    assert main([*args, f"run.output_dir={tmp_path}", "run.name=moe"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # the same fp32 weights on both sides: the trainer's router picks the rollout's experts nearly always,
        # and with them replayed the log-prob gap is rounding (1e-5 leaves ~100x, as for dense models)
        assert 0.9 <= row["moe/routing_agreement"] <= 1.0
        assert row["moe/expert_load"] >= 1.0 and math.isfinite(row["actor/kl"])
        assert row["rollout/logprob_abs_diff"] < 1e-5
        # each pass sends every token's 2 slots x H=64 fp32 out and back per MoE layer (2 layers): 2 KiB a
        # token and pass; a rank's 8 rows of >= 10 tokens, reference + update forward + backward: > 0.4 MiB
        assert row["moe/all_to_all_mb"] > 0.1
    summary = json.loads((tmp_path / "moe" / "summary.json").read_text())
    exported = load_model(f"{summary['checkpoint']}/hf")  # per-expert files, read back fused
    assert exported.args.num_experts == 8 and exported.args.moe_layers == [0, 1]
    # exact resume: from step 2's checkpoint (experts split over ep=2 in DCP), step 3 again, bit for bit
    resumed = [*args, f"run.output_dir={tmp_path}", "run.name=resumed"]
    assert main([*resumed, f"run.resume={tmp_path}/moe/checkpoints/step_000002"]) == 0
    expected = computed_metrics(tmp_path / "moe")
    again = computed_metrics(tmp_path / "resumed")  # steps 1-2 carried over from the checkpoint's run
    assert again == expected, metric_differences(again, expected)


@pytest.mark.parametrize(
    "extra, model, expected",
    [
        (
            ["algo.routing_replay=r3"],
            "dense",
            "algo.routing_replay='r3': replays experts, and model.path=.* dense",
        ),
        (
            ["algo.routing_replay=r3", "rollout.backend=vllm"],
            "moe",
            "rollout.backend=vllm does not record them",
        ),
        (["algo.routing_replay=r3", "env.name=tools"], "moe", "multi-turn trajectories"),
        (["actor.tp=2"], "moe", "tensor parallelism of MoE layers is not built yet"),
        (["actor.dp=2", "actor.ep=2"], "dense", "actor.ep=2: splits experts, and model.path=.* dense"),
        (
            ["actor.dp=3", "actor.ep=3", "run.prompts_per_step=6"],
            "moe",
            "does not divide the model's num_experts=8",
        ),
        (["actor.dp=4", "actor.ep=3"], "moe", "actor.ep=3: does not divide actor.dp=4"),
    ],
)
def test_moe_config_errors(tiny_model, moe_model, arithmetic_data, extra, model, expected):
    path = tiny_model if model == "dense" else moe_model
    base = [f"model.path={path}", f"data.train_path={arithmetic_data['train']}", "run.steps=1"]
    base += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    with pytest.raises(ConfigError, match=expected):
        preflight_train(load_config(TrainConfig, None, base + extra))


def test_lora_on_expert_projections_is_refused(moe_model, arithmetic_data):
    base = [f"model.path={moe_model}", f"data.train_path={arithmetic_data['train']}", "run.steps=1"]
    base += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2", "actor.lora.rank=4"]
    with pytest.raises(
        ConfigError, match=r"names MLP projections \['gate_proj'\].*LoRA on experts is not built"
    ):
        preflight_train(
            load_config(TrainConfig, None, [*base, "actor.lora.target_modules=[q_proj,gate_proj]"])
        )
    preflight_train(load_config(TrainConfig, None, [*base, "actor.lora.target_modules=[q_proj,v_proj]"]))
    preflight_train(load_config(TrainConfig, None, base))  # all-linear: the attention on an all-MoE model
