"""The asynchronous schedule queues generations without waiting (review m2): starting step s's generation names
its dock in the rollout and scoring calls (each worker selects it when the call starts, after its running
calls) and never makes a separate dock-switching call, which would wait behind the generations still running
and cap the overlap at one step whatever rollout.max_staleness is. Driven with fakes: no Ray."""

from types import SimpleNamespace

from dockrl.recipes import async_step
from dockrl.recipes.common import EncodedPrompt, EpochSampler


class _Group:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def select_dock(self, dock: int) -> None:  # waits for every running call of the group: must not be used
        raise AssertionError(f"{self.name}.select_dock({dock}) waits behind the running generations")

    def generate(self, step: int, version: int, dock: int | None = None):
        self.log.append((self.name, "generate", step, version, dock))
        return "pending"

    def score(self, dock: int | None = None):
        self.log.append((self.name, "score", dock))
        return "pending"


def test_starting_a_generation_names_its_dock_and_never_waits_to_switch(monkeypatch):
    log: list = []
    client = SimpleNamespace(
        select=lambda dock: log.append(("driver", "select", dock)),
        add_groups=lambda *args: log.append(("driver", "add_groups")),
    )
    cluster = SimpleNamespace(
        client=client,
        rollouts=_Group(log, "rollouts"),
        rewards=_Group(log, "rewards"),
        reward_models=_Group(log, "reward_models"),
        teacher=_Group(log, "teacher"),
    )
    monkeypatch.setattr(async_step, "sync_rollout_weights", lambda cluster, version: 0.0)
    prompts = [EncodedPrompt(ids=[1, 2], text="p", label="1", index=i) for i in range(4)]
    sampler = EpochSampler(prompts, 2, shuffle=False, seed=0)
    cfg = SimpleNamespace(rollout=SimpleNamespace(samples_per_prompt=2))
    schedule = SimpleNamespace(lead=2)
    for step in (1, 2, 3):  # k = 2: three docks; step s in dock s mod 3 with the weights after s - 3
        generation = async_step._start_generation(cfg, schedule, step, sampler, cluster)
        assert generation.dock == step % 3 and generation.version == max(0, step - 3)
    calls = [entry for entry in log if entry[0] != "driver"]
    assert calls == [
        entry
        for step in (1, 2, 3)
        for entry in (
            ("reward_models", "score", step % 3),
            ("teacher", "score", step % 3),
            ("rollouts", "generate", step, 0, step % 3),
            ("rewards", "score", step % 3),
        )
    ]
