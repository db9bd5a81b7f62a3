"""The synchronous schedule starts the reference stage when generation ends, before it waits for the scoring of
the last groups: the reference reads only the rows' tokens, and the reward workers are other processes, so a
slow reward (a sandboxed run, a remote judge) hides the reference instead of adding to it. The stage's time is
its slowest rank's own. Driven with fakes: no Ray (the order of the driver's calls is what is checked)."""

from types import SimpleNamespace

from dockrl.dock.stages import Stage
from dockrl.observe.run_dir import StageTimer
from dockrl.recipes import sync_step
from dockrl.recipes.common import EncodedPrompt
from dockrl.workers.results import LogprobResult


class _Pending:
    def __init__(self, log: list, name: str, result) -> None:
        self.log, self.name, self.result = log, name, result

    def wait(self):
        self.log.append(("wait", self.name))
        return self.result


class _Actors:
    def __init__(self, log: list) -> None:
        self.log = log

    def generate(self, step: int) -> _Pending:
        self.log.append(("start", "generate"))
        return _Pending(self.log, "generate", [])

    def compute_ref(self) -> _Pending:
        self.log.append(("start", "reference"))
        ranks = [
            LogprobResult(rows=4, tokens=40, seconds=0.25),
            LogprobResult(rows=4, tokens=40, seconds=0.5),
        ]
        return _Pending(self.log, "reference", ranks)


def _cluster(log: list) -> SimpleNamespace:
    rewards = SimpleNamespace(score=lambda: log.append(("start", "score")) or _Pending(log, "score", []))
    client = SimpleNamespace(add_groups=lambda *args: None)
    return SimpleNamespace(
        client=client,
        actors=_Actors(log),
        rollouts=None,
        rewards=rewards,
        reward_models=None,
        teacher=None,
        critic=None,
    )


def _round(monkeypatch, plan) -> tuple[list, sync_step.Started | None, StageTimer]:
    log: list = []
    monkeypatch.setattr(sync_step, "add_prompts", lambda client, batch, n: None)
    monkeypatch.setattr(sync_step, "sync_rollout_weights", lambda cluster, version: 0.0)
    cfg = SimpleNamespace(rollout=SimpleNamespace(samples_per_prompt=2))
    schedule = SimpleNamespace(partial=False)
    batch = [EncodedPrompt(ids=[1, 2], text="p", label="1", index=i) for i in range(4)]
    timer = StageTimer()
    *_, reference = sync_step._round(cfg, schedule, 1, batch, _cluster(log), timer, plan)
    return log, reference, timer


def test_the_reference_starts_when_generation_ends_before_the_scoring_wait(monkeypatch):
    log, reference, timer = _round(monkeypatch, SimpleNamespace(reference=True, old_logprobs=False))
    assert log == [
        ("start", "generate"),
        ("start", "score"),
        ("wait", "generate"),
        ("start", "reference"),
        ("wait", "score"),
    ]
    sync_step.logprob_stages(SimpleNamespace(reference=True, old_logprobs=False), None, timer, reference)
    assert log[-1] == ("wait", "reference")
    assert timer.seconds[Stage.REFERENCE] == 0.5  # the slowest rank's own seconds, not the driver's wait


def test_without_a_plan_or_a_reference_nothing_starts_early(monkeypatch):
    for plan in (None, SimpleNamespace(reference=False, old_logprobs=False)):
        log, reference, _ = _round(monkeypatch, plan)
        assert reference is None and ("start", "reference") not in log
