"""RewardModelWorker: scores whole groups with a reward model (a scalar `score` head) as soon as they finish.

    loop: pull whole groups (prompt_ids, response_ids) ─▶ token ids in the reward model's vocabulary
          ─▶ score head, micro-batches of similar lengths ─▶ put rm_score
    ends when the dock has no unserved rows for the `reward_model` consumer

    actor ranks ──response_ids──▶ dock ──▶ RewardModelWorker ──rm_score──▶ dock ──▶ RewardWorker
                                       └─────────────────────────────────────────▶ (rule rewards, then
                                                                                    + weight x rm_score)

The RewardWorker reads `rm_score` with its other columns, so a group reaches it once both the actor and the
reward model are done with it; both stages pull groups while later ones still generate.

Vocabulary: when the reward model's tokenizer has the policy's vocabulary (same token -> id map), the dock's
ids go in unchanged. Otherwise prompt + response are decoded with the policy's tokenizer (special tokens
kept) and encoded with the reward model's: the reward model then reads the policy's chat markup, so its
scores mean most when it was trained on the same chat format.

Lifecycle: the model is loaded once in `__init__` (on this actor's GPU with run.device=cuda, bf16 with
run.precision=bf16) and kept for the whole run; `score` is called once per step.
"""

from __future__ import annotations

import math
import time

import torch

from dockrl.config.specs import RewardModelSpec
from dockrl.dock.choice import DockChoice
from dockrl.dock.columns import PROMPT_IDS, RESPONSE_IDS, RM_SCORE
from dockrl.dock.stages import Stage
from dockrl.models.classifier import load_reward_model
from dockrl.models.precision import dtype_of
from dockrl.models.tokenizer import Tokenizer, same_vocabulary
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import ModelScoreResult


def rm_token_ids(
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    policy_tokenizer: Tokenizer,
    rm_tokenizer: Tokenizer | None,
) -> list[int]:
    """prompt + response as reward-model token ids; rm_tokenizer None means the vocabularies are the same."""
    ids = prompt_ids.tolist() + response_ids.tolist()
    if rm_tokenizer is None:
        return ids
    return rm_tokenizer.encode(policy_tokenizer.decode(ids, skip_special_tokens=False))


class RewardModelWorker(Worker):
    """Serves the `reward_model` consumer: one `rm_score` (float) per row; one or more per job."""

    def __init__(self, name: str, rank: int, world_size: int, *, spec: RewardModelSpec, client: DockChoice):
        super().__init__(name, rank, world_size, num_threads=1 if spec.device == "cpu" else None)
        model = spec.reward_model
        self.cfg, self.client = model, client
        self.group_size, self.groups_per_pull = spec.group_size, spec.groups_per_pull
        # Ray gives a GPU actor exactly one visible device.
        self.device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        dtype = dtype_of(spec.precision)
        path = model.path
        assert path is not None, "RewardModelWorkers start only with reward.model.path set"
        self.model = load_reward_model(path, device=self.device, dtype=dtype).eval()
        self.policy_tokenizer = Tokenizer.from_dir(spec.policy_path)
        self.rm_tokenizer = None if same_vocabulary(spec.policy_path, path) else Tokenizer.from_dir(path)

    def score(self, dock: int | None = None) -> ModelScoreResult:
        """Score every row of the step once; returns the scores (row order of pulls) and the busy time. `dock`:
        as RewardWorker.score."""
        if dock is not None:
            self.client.select(dock)
        n = self.group_size
        scores: list[float] = []
        busy_s = 0.0
        while True:
            got = self.client.get(
                Stage.REWARD_MODEL,
                [PROMPT_IDS, RESPONSE_IDS],
                self.groups_per_pull * n,
                whole_groups=True,
                min_count=n,
            )
            if got is None:
                break
            start = time.perf_counter()
            rows, batch = got
            sequences = [
                rm_token_ids(p, r, self.policy_tokenizer, self.rm_tokenizer)
                for p, r in zip(batch[PROMPT_IDS], batch[RESPONSE_IDS])
            ]
            values = self.model.score_sequences(sequences, self.cfg.micro_batch_size)
            bad = [row for row, value in zip(rows, values) if not math.isfinite(value)]
            if bad:
                raise ValueError(
                    f"reward model {self.cfg.path} gave non-finite scores for rows {bad[:5]}; with "
                    "run.precision=bf16 try run.precision=fp32"
                )
            self.client.put(Stage.REWARD_MODEL, rows, {RM_SCORE: values})
            scores += values
            busy_s += time.perf_counter() - start
        return ModelScoreResult(scores, busy_s)


class RewardModelGroup(WorkerGroup):
    """The RewardModelWorkers, one typed method per stage."""

    worker = RewardModelWorker

    def score(self, dock: int | None = None) -> Pending[ModelScoreResult]:
        """Score every row of the step (of dock `dock` in an asynchronous run) with the reward model."""
        return self.start(RewardModelWorker.score, dock)
