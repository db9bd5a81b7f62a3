"""Config loading and validation: every bad input is a clear error, raised before Ray starts."""

import json

import pytest

from dockrl.cli import main
from dockrl.config import ConfigError, TrainConfig, load_config, render_docs
from dockrl.recipes.preflight import preflight_train


def _base(tiny_model, arithmetic_data) -> list[str]:
    return [
        f"model.path={tiny_model}",
        f"data.train_path={arithmetic_data['train']}",
        "run.steps=1",
        "run.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
    ]


def test_yaml_and_overrides(tmp_path, tiny_model, arithmetic_data):
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  steps: 3\n  prompts_per_step: 8\nactor:\n  lr: 1.0e-4\n")
    cfg = load_config(
        TrainConfig,
        path,
        [
            f"model.path={tiny_model}",
            f"data.train_path={arithmetic_data['train']}",
            "actor.lr=2e-5",
            "reward.functions=[{name: format, weight: 0.5}]",
        ],
    )
    assert cfg.run.steps == 3 and cfg.run.prompts_per_step == 8
    assert cfg.actor.lr == pytest.approx(2e-5)
    assert cfg.reward.functions[0].name == "format" and cfg.reward.functions[0].weight == 0.5
    cfg = preflight_train(cfg).cfg  # the resolved copy
    from dockrl.recipes.preflight import cpu_has_native_bf16

    assert cfg.run.device == "cpu" and cfg.run.precision == ("bf16" if cpu_has_native_bf16() else "fp32")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("actor.lrr=1e-5", "did you mean actor.lr"),
        ("rollout.temprature=0.7", "did you mean rollout.temperature"),
        ("run.steps=ten", "run.steps='ten' has the wrong type"),
        ("actor.dp=1.5", "actor.dp=1.5 has the wrong type"),
        ("data.shuffle=7", "data.shuffle=7 has the wrong type"),
    ],
)
def test_unknown_key_and_wrong_type(tiny_model, arithmetic_data, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + [override])


def test_missing_required_names_the_key():
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(TrainConfig, None, ["data.train_path=x", "run.steps=1", "run.prompts_per_step=1"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rollout.samples_per_prompt=0", "rollout.samples_per_prompt=0: must be >= 1"),
        ("actor.dp=3", "not divisible by actor.dp=3"),
        ("actor.mini_batches=3", "actor.mini_batches=3: does not divide the 8 rows"),
        ("algo.kl_estimator=k7", "algo.kl_estimator='k7': unknown estimator"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5"),
        ("reward.functions=[{name: no_such_fn}]", "reward.functions\\[0\\].name='no_such_fn'"),
        ("run.device=tpu", "run.device='tpu': unknown device"),
        ("reshard.bucket_mb=0.01", "reshard.bucket_mb=0.01: is smaller than the model's largest tensor"),
        ("actor.tp=3", "actor.tp=3"),
        ("rollout.kv_cache_tokens=-1", "rollout.kv_cache_tokens=-1: must be >= 0"),
        ("actor.fsdp_unit_params=-1", "actor.fsdp_unit_params=-1: must be >= 0"),
        ("critic.fsdp_unit_params=-5", "critic.fsdp_unit_params=-5: must be >= 0"),
        ("rollout.kv_cache_tokens=100", "rollout.kv_cache_tokens=100: cannot hold one sequence"),
        ("run.threads_per_rank=-1", r"run.threads_per_rank=-1: must be >= 0.*use 0 \(auto"),
    ],
)
def test_validation_errors(tiny_model, arithmetic_data, override, expected):
    with pytest.raises(ConfigError, match=expected):  # closed choices fail at load, the rest in validation
        preflight_train(load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + [override]))


def test_threads_per_rank_set_or_auto(tiny_model, arithmetic_data):
    """run.threads_per_rank=N gives each trainer rank N threads (on cuda too); 0 splits the cores over the ranks
    on cpu and leaves torch's default on cuda."""
    import os

    from dockrl.recipes.cluster import threads_per_rank

    def cfg(*overrides: str) -> TrainConfig:
        return load_config(TrainConfig, None, [*_base(tiny_model, arithmetic_data), *overrides])

    cores = os.cpu_count() or 1
    above = cores + 1  # never the auto value, which is at most the cores
    assert threads_per_rank(cfg("run.device=cpu"), 1) == cores
    assert threads_per_rank(cfg("run.device=cpu"), 2) == max(1, cores // 2)
    assert threads_per_rank(cfg("run.device=cuda"), 2) is None
    assert threads_per_rank(cfg("run.device=cpu", f"run.threads_per_rank={above}"), 1) == above
    assert threads_per_rank(cfg("run.device=cuda", "run.threads_per_rank=3"), 2) == 3


def test_threads_per_rank_oversubscribing_the_cores_warns(tiny_model, arithmetic_data):
    import os
    import warnings

    cores = os.cpu_count() or 1
    base = [*_base(tiny_model, arithmetic_data), "run.device=cpu", "actor.dp=2"]
    with pytest.warns(UserWarning, match=rf"run.threads_per_rank={cores} x 2 trainer ranks .* oversubscribe"):
        resolved = preflight_train(load_config(TrainConfig, None, [*base, f"run.threads_per_rank={cores}"]))
    assert resolved.cfg.run.threads_per_rank == cores  # allowed, not refused
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*oversubscribe")
        preflight_train(load_config(TrainConfig, None, [*base, f"run.threads_per_rank={max(1, cores // 2)}"]))


def test_missing_model_dir_and_prompt_field(tmp_path, tiny_model, arithmetic_data):
    cfg = load_config(
        TrainConfig, None, _base(tiny_model, arithmetic_data) + [f"model.path={tmp_path / 'nope'}"]
    )
    with pytest.raises(ConfigError, match="model.path=.*the model directory does not exist"):
        preflight_train(cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    cfg = load_config(TrainConfig, None, _base(tiny_model, arithmetic_data) + [f"data.train_path={bad}"])
    with pytest.raises(ValueError, match="prompt") as err:
        preflight_train(cfg)
    assert "bad.jsonl" in str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("run.stepz=2", "did you mean run.steps"),
        ("rollout.samples_per_prompt=0", "samples_per_prompt=0"),
        ("actor.dp=3", "actor.dp=3"),
        ("model.path=/no/such/model", "model directory does not exist"),
    ],
)
def test_cli_errors_before_ray_starts(
    monkeypatch, capsys, tmp_path, tiny_model, arithmetic_data, override, expected
):
    import dockrl.recipes.grpo as grpo

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started before the config was validated")

    monkeypatch.setattr(grpo, "init_ray", forbidden)
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    code = main(["train", str(config), *_base(tiny_model, arithmetic_data), override])
    assert code == 2
    assert expected in capsys.readouterr().err


def test_every_setting_is_documented():
    rows = render_docs(TrainConfig)
    assert len(rows) > 40
    undocumented = [r for r in rows if r.rstrip().endswith("|  |")]
    assert undocumented == []


def test_docs_config_md_is_current(capsys):
    from pathlib import Path

    main(["config-docs"])
    rendered = capsys.readouterr().out
    path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert path.read_text() == rendered, "docs/config.md is stale: run `dockrl config-docs > docs/config.md`"


def test_gpu_example_config_parses():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "grpo_qwen2.5_0.5b_gsm8k.yaml"
    cfg = load_config(TrainConfig, path)
    assert cfg.actor.dp == 8 and cfg.run.device == "cuda" and cfg.reward.functions[0].name == "math_verify"


def test_user_errors_are_one_line_unless_debug(monkeypatch, capsys, tmp_path, tiny_model, arithmetic_data):
    """A ValueError from outside config validation (here: every prompt longer than data.max_prompt_len) ends
    as one error line and a hint, exit 2; --debug (or DOCKRL_DEBUG=1) raises it with its traceback."""
    import dockrl.recipes.grpo as grpo

    monkeypatch.setattr(grpo, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    args = ["train", str(config), *_base(tiny_model, arithmetic_data), "data.max_prompt_len=2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("dockrl train: error: ") and "--debug" in err[1]
    with pytest.raises(ValueError):
        main(["--debug", *args])
    monkeypatch.setenv("DOCKRL_DEBUG", "1")
    with pytest.raises(ValueError):
        main(args)


def test_a_run_directory_that_holds_a_run_is_refused(
    monkeypatch, capsys, tmp_path, tiny_model, arithmetic_data
):
    """run.resume=never (the default) never appends a new run to an old one's records: refused before Ray
    starts, naming the directory and the ways out; run.resume=auto continues it."""
    import dockrl.recipes.grpo as grpo

    monkeypatch.setattr(grpo, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    run = tmp_path / "runs" / "taken"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    args = ["train", str(config), *_base(tiny_model, arithmetic_data), f"run.output_dir={tmp_path / 'runs'}"]
    assert main([*args, "run.name=taken"]) == 2
    err = capsys.readouterr().err
    assert f"run.name='taken': {run} already holds a run" in err and "run.resume=auto" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing lost


def test_unknown_loggers_are_named(tiny_model, arithmetic_data):
    cfg = load_config(
        TrainConfig, None, [*_base(tiny_model, arithmetic_data), "run.loggers=[jsonl, neptune]"]
    )
    with pytest.raises(
        ConfigError, match=r"run.loggers=\['jsonl', 'neptune'\]: unknown logger\(s\) \['neptune'\]"
    ):
        preflight_train(cfg)


def test_auto_precision_takes_bf16_where_the_hardware_computes_it():
    """run.precision=auto: bf16 on cuda and on a cpu with native bf16 (at any model size), fp32 elsewhere."""
    from dockrl.recipes.preflight import cpu_has_native_bf16, resolve_precision

    native = "bf16" if cpu_has_native_bf16() else "fp32"
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("auto", "cpu") == native
    assert resolve_precision("fp32", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
