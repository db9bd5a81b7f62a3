"""RewardWorker: a CPU actor that scores whole groups as soon as they are generated.

    loop: pull whole groups (prompt_ids, response_ids, label) ─▶ decode ─▶ reward functions (process pool,
          per-call timeout) ─▶ group-normalised advantages ─▶ put reward, reward/<component>, advantages
    ends when the dock has no unserved rows for the `reward` consumer

Because it pulls whole groups while the actor still generates later ones, reward work overlaps rollout.
"""

from __future__ import annotations

from typing import Any

import torch

from dockrl.algos.advantages import group_normalized_advantages
from dockrl.config.schema import AlgoConfig, RewardConfig
from dockrl.dock.client import DockClient
from dockrl.models.tokenizer import Tokenizer
from dockrl.rewards.runner import RewardRunner, RewardSpec
from dockrl.workers.group import Worker

REWARD = "reward"


def reward_specs(cfg: RewardConfig) -> list[RewardSpec]:
    """Config entries -> runner specs."""
    return [RewardSpec(name=f.name, weight=f.weight, kwargs=dict(f.kwargs)) for f in cfg.functions]


def accuracy_key(components: dict[str, list[float]]) -> str | None:
    """The component that says whether an answer is correct (`<fn>/correct`), if any function reports one."""
    return next((k for k in components if k.endswith("/correct")), None)


class RewardWorker(Worker):
    """Scores rows and computes GRPO advantages; one or more per job."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        reward: RewardConfig,
        algo: AlgoConfig,
        tokenizer_path: str,
        client: DockClient,
        group_size: int,
        log_samples: int = 0,
    ):
        super().__init__(name, rank, world_size, num_threads=1)
        self.cfg, self.algo, self.client, self.group_size = reward, algo, client, group_size
        self.log_samples = log_samples
        self.tokenizer = Tokenizer.from_dir(tokenizer_path)
        self.runner = RewardRunner(
            reward_specs(reward), timeout_s=reward.timeout_s, num_processes=reward.num_processes
        )

    def score(self) -> dict[str, Any]:
        """Serve the `reward` consumer until every row is scored; returns per-row figures for metrics."""
        n = self.group_size
        rewards: list[float] = []
        correct: list[float] = []
        timeouts = errors = 0
        samples: list[dict[str, Any]] = []
        while True:
            got = self.client.get(
                REWARD,
                ["prompt_ids", "response_ids", "label"],
                self.cfg.groups_per_pull * n,
                whole_groups=True,
                min_count=n,
            )
            if got is None:
                break
            rows, batch = got
            assert len({r // n for r in rows}) * n == len(rows), "the dock served a partial group"
            prompts = [self.tokenizer.decode(p.tolist()) for p in batch["prompt_ids"]]
            responses = [self.tokenizer.decode(r.tolist()) for r in batch["response_ids"]]
            scores, components, stats = self.runner.score(prompts, responses, batch["label"])
            adv = group_normalized_advantages(
                torch.tensor(scores, dtype=torch.float32),
                n,
                eps=self.algo.adv_eps,
                normalize_std=self.algo.norm_adv_by_std,
            )
            out: dict[str, list] = {
                "reward": list(scores),
                "advantages": [torch.full((len(r),), float(a)) for r, a in zip(batch["response_ids"], adv)],
            }
            out.update({f"reward/{k}": v for k, v in components.items()})
            self.client.put(rows, out)
            rewards += scores
            key = accuracy_key(components)
            if key is not None:
                correct += components[key]
            timeouts += stats.get("timeouts", 0)
            errors += stats.get("errors", 0)
            for i in range(min(self.log_samples - len(samples), len(rows))):
                samples.append(
                    {
                        "row": rows[i],
                        "prompt": prompts[i],
                        "response": responses[i],
                        "label": _jsonable(batch["label"][i]),
                        "reward": scores[i],
                    }
                )
        return {
            "rewards": rewards,
            "correct": correct,
            "timeouts": timeouts,
            "errors": errors,
            "samples": samples,
        }

    def close(self) -> None:
        """Stop the reward process pool."""
        self.runner.close()


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)
