"""LoRA GRPO end to end through the CLI: steps trained tensor-parallel (tp=2) with adapters on every linear
layer, generated with tp=1 from the merged weights, the KL reference from the adapters switched off.

The checkpoints hold the adapters only (actor/: adapters, their AdamW state, and a pointer to the base;
adapter/: a PEFT directory); a run resumed from step 1's checkpoint repeats step 2 bit for bit; `dockrl export`
writes the PEFT directory or (--merge) the merged model; `dockrl eval` and model.path take the LoRA checkpoint
root."""

import json
import math
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dockrl.cli import main
from dockrl.models.hf import load_state_dict
from dockrl.models.lora import read_peft_adapters, read_peft_spec
from runs import computed_metrics, metric_differences

CONFIG = (
    "rollout: {samples_per_prompt: 4, max_new_tokens: 6, groups_per_pull: 2, tp: 1}\n"
    "actor: {dp: 1, tp: 2, lr: 1.0e-2, micro_batch_size: 4, lora: {rank: 4, alpha: 8}}\n"
    "algo: {kl_coef: 0.01}\n"
    "reward: {functions: [{name: exact_answer}, {name: 'reward_fixtures:length_reward', weight: 0.1}]}\n"
    "run: {steps: 2, prompts_per_step: 4, save_every: 1, progress: false, worker_timeout_s: 300, "
    "precision: fp32}\n"
)


@pytest.fixture(scope="module")
def lora_run(ray_session, tmp_path_factory, tiny_model, arithmetic_data):
    root = tmp_path_factory.mktemp("lora")
    config = root / "lora.yaml"
    config.write_text(CONFIG)
    args = [
        "train",
        str(config),
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        f"run.output_dir={root}",
    ]
    assert main([*args, "run.name=lora"]) == 0
    return root, args


def test_two_lora_grpo_steps_through_cli(lora_run):
    root, _ = lora_run
    rows = computed_metrics(root / "lora")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("actor/grad_norm", "actor/kl", "reward/mean"):
            assert math.isfinite(row[key]), key
        assert row["actor/grad_norm"] > 0
    # Step 1's policy is the base (B = 0): its KL to the reference (the same weights, adapters off) is 0 up to
    # the rounding of two passes batched differently (log-prob gaps ~1e-7, k3 ~ gap^2 / 2).
    assert 0 <= rows[0]["actor/kl"] < 1e-9


def test_checkpoints_hold_the_adapters_only(lora_run, tiny_model):
    root, _ = lora_run
    checkpoint = root / "lora" / "checkpoints" / "step_000002"
    assert not (checkpoint / "hf").exists()  # no full model per checkpoint
    saved = dcp.FileSystemReader(str(checkpoint / "actor")).read_metadata().state_dict_metadata
    tensors = [k for k in saved if k.startswith(("model/", "optim/"))]
    assert tensors and all(".lora_A" in k or ".lora_B" in k for k in tensors)
    model_keys = [k for k in tensors if k.startswith("model/")]
    assert len(model_keys) == 2 * 7 * 2  # two factors of 7 linear layers in each of the 2 layers
    assert "lora_base" in saved
    adapter = read_peft_adapters(checkpoint / "adapter")
    assert len(adapter) == len(model_keys)
    config = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model.resolve())


def test_resume_from_an_adapter_checkpoint_repeats_the_run(lora_run):
    root, args = lora_run
    shutil.copytree(root / "lora", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / "step_000002")
    assert main([*args, "run.name=resumed", "run.resume=auto"]) == 0
    resumed, expected = computed_metrics(root / "resumed"), computed_metrics(root / "lora")
    assert resumed == expected, metric_differences(resumed, expected)
    step2 = "checkpoints/step_000002/adapter"
    again, original = read_peft_adapters(root / "resumed" / step2), read_peft_adapters(root / "lora" / step2)
    assert set(again) == set(original)
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_export_writes_the_adapter_and_the_merged_model(lora_run, tiny_model, capsys):
    root, _ = lora_run
    checkpoint = root / "lora" / "checkpoints" / "step_000002"
    assert main(["export", str(checkpoint), str(root / "peft")]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "peft_adapter"
    assert main(["export", str(checkpoint), str(root / "merged"), "--merge"]) == 0
    assert json.loads(capsys.readouterr().out)["merged_layers"] == 14
    adapters, spec = read_peft_adapters(root / "peft"), read_peft_spec(root / "peft")
    assert adapters.keys() == read_peft_adapters(checkpoint / "adapter").keys() and spec.scaling == 2.0
    merged, base = load_state_dict(root / "merged"), load_state_dict(tiny_model)
    assert set(merged) == set(base)
    moved = 0
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A" not in adapters:
            assert torch.equal(merged[name], weight), name  # frozen: only adapted weights change
            continue
        delta = spec.scaling * (adapters[f"{module}.lora_B"] @ adapters[f"{module}.lora_A"])
        # W + s B A in fp32 on both sides; B A is a dot product of r terms: at most r + 2 roundings of the
        # magnitudes, each of relative size 2^-24.
        magnitude = weight.abs() + spec.scaling * (
            adapters[f"{module}.lora_B"].abs() @ adapters[f"{module}.lora_A"].abs()
        )
        assert ((merged[name] - (weight + delta)).abs() <= (spec.rank + 2) * 2.0**-24 * magnitude).all(), name
        moved += bool(delta.abs().max() > 0)
    assert moved == 14, "every adapter moved in two updates"
    # PEFT loads the exported adapter onto the transformers base with dockrl's logits (tests/unit/test_lora.py's
    # parity bound: other kernels, other summation order, the same two adapter matmuls on both sides).
    peft, transformers = pytest.importorskip("peft"), pytest.importorskip("transformers")
    from dockrl.models.hf import load_model
    from dockrl.models.lora import load_peft
    from helpers import PARITY_BOUND

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, root / "peft").eval()(input_ids=ids).logits
        ours = load_model(tiny_model).eval()
        load_peft(ours, root / "peft")
        assert (theirs - ours(ids)).abs().max().item() < PARITY_BOUND
        assert (theirs - load_model(root / "merged").eval()(ids)).abs().max().item() < PARITY_BOUND
    # A full model has nothing to merge; a LoRA root is no Hugging Face directory by itself.
    assert main(["export", str(root / "merged"), str(root / "again"), "--merge"]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err


def test_eval_and_model_path_take_a_lora_checkpoint(lora_run, arithmetic_data, capsys):
    root, args = lora_run
    checkpoint = root / "lora" / "checkpoints" / "step_000002"
    if not (root / "merged").is_dir():  # run alone: the export test writes it
        assert main(["export", str(checkpoint), str(root / "merged"), "--merge"]) == 0
    capsys.readouterr()
    data = ["--data", str(arithmetic_data["test"]), "--limit", "8"]
    assert main(["eval", "--model", str(checkpoint), *data, "--records", str(root / "a.jsonl")]) == 0
    assert main(["eval", "--model", str(root / "merged"), *data, "--records", str(root / "b.jsonl")]) == 0
    # The root's base with its adapters merged in process is the merged export: the same greedy answers.
    assert (root / "a.jsonl").read_text() == (root / "b.jsonl").read_text()

    from dockrl.config import TrainConfig, load_config
    from dockrl.recipes.preflight import preflight_train

    cfg = load_config(TrainConfig, args[1], [*args[2:], f"model.path={checkpoint}"])
    resolved = preflight_train(cfg).cfg
    base = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert resolved.model.path == base
    assert resolved.model.lora_path == str(checkpoint / "adapter") and resolved.actor.lora.rank == 4


def test_separate_replicas_generate_with_the_adapters_they_receive(lora_run):
    """rollout.placement=separate under LoRA, one step off-policy (max_staleness=1): the replicas hold the base
    and receive the adapters only. Step 1 is generated and trained with the initial adapters, so its
    trainer-vs-rollout mismatch (rollout/logprob_abs_diff, mean |d| per token) is fp32 rounding only (two
    computations of the same unmerged forward, batched differently); step 2 was generated one update behind,
    and the same metric shows that update's movement, orders of magnitude larger."""
    root, args = lora_run
    separate = [*args, "rollout.placement=separate", "run.save_every=0", "rollout.max_staleness=1"]
    assert main([*separate, "run.name=separate_async"]) == 0
    rows = [json.loads(line) for line in (root / "separate_async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0]
    rounding, moved = rows[0]["rollout/logprob_abs_diff"], rows[1]["rollout/logprob_abs_diff"]
    # Worst-case fp32 rounding of the forward's widest dot product (the MLP's 192 = 3 x 64 terms), K u relative,
    # on log-probs of magnitude about 1: measured ~1e-7 (two ulps), far below one update's movement (~1e-2).
    assert rounding < 192 * 2.0**-24
    assert moved > 100 * rounding


@pytest.mark.parametrize("reference", ["adapter", "base"])
def test_a_starting_adapter_is_the_kl_reference_unless_the_base_is_asked_for(lora_run, reference):
    """model.lora_path = step 2's adapter (trained, B != 0), tp=2: with algo.kl_reference=adapter (the default)
    the reference at step 1 is the policy itself, so actor/kl (k3) is within fp32 rounding of 0: each token's
    log-prob within 1e-5 (the rollout-trainer bound), k3 ~ d^2 / 2 < 5e-11. With =base it is the raw base, which
    the trained adapter moved away from: far above (the check sees which reference was computed)."""
    root, args = lora_run
    adapter = root / "lora" / "checkpoints" / "step_000002" / "adapter"
    name = f"from_adapter_{reference}"
    more = [f"model.lora_path={adapter}", f"algo.kl_reference={reference}", "run.steps=1", "run.save_every=0"]
    assert main([*args, *more, f"run.name={name}"]) == 0
    (row,) = computed_metrics(root / name)
    if reference == "adapter":
        assert row["actor/kl"] < 0.5 * 1e-5**2
    else:
        assert row["actor/kl"] > 0.5 * 1e-5**2
