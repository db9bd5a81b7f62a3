"""TeacherWorker: one rank of on-policy distillation's teacher, which scores the student's own tokens.

    loop: pull whole groups as rollout finishes them (prompt_ids, response_ids, rollout_logprobs[, loss_mask])
          ─▶ the teacher's log-prob of every response token (the fused head: no [B, T, V] logits)
             [distill.top_k = k: and its k most likely ids at every response position, with their log-probs]
          ─▶ put teacher_logprobs [top-k: teacher_topk_ids, teacher_topk_logprobs, which the update reads]
    ends when no rank of the group got rows (one all-reduce per pull: the ranks stay in lockstep)

    rollout ──response_ids──▶ dock ──▶ TeacherWorkers ──teacher_logprobs──▶ dock ──▶ RewardWorker
                                  └─────────────────────────────────────────────────▶ (advantages +=
                                                                   distill.coef x (teacher - rollout log-prob))

Placement: distill.num_workers ranks in a process group of their own (one GPU each on cuda, beside the
actor's), a (dp, cp, tp) grid as the actor's, the teacher sharded like the actor's reference model: FSDP2 over
num_workers / distill.tp ranks, tensor parallelism over distill.tp and context parallelism over distill.cp (each
sequence split over cp ranks, parallel/context.py; the head of each cp x tp block talks to the dock,
parallel/replica.py, and its peers score the same rows). Every
forward is collective, so each pull ends with an all-reduce of how many micro-batches each rank needs, and a
rank with fewer rows (or none: the step ran out) runs idle ones (TrainEngine.logprobs). Because the teacher
pulls groups as they finish, its work overlaps the rollout, like reward scoring; the RewardWorker reads
teacher_logprobs, so a group's advantages are written once both are done.

The teacher's log-probs are taken at the rollout's temperature (the student's rollout_logprobs are), so the
per-token difference is the reverse KL of the distributions the student sampled from (algos/distill.py).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dockrl.algos.distill import DistillSums
from dockrl.config.specs import TeacherSpec
from dockrl.dock.choice import DockChoice
from dockrl.dock.columns import (
    LOSS_MASK,
    PROMPT_IDS,
    RESPONSE_IDS,
    ROLLOUT_LOGPROBS,
    TEACHER_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
)
from dockrl.dock.stages import Stage
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.hf import read_config
from dockrl.models.tokenizer import Tokenizer, first_token_id
from dockrl.parallel.dist import training_mesh
from dockrl.parallel.replica import ReplicaClient
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import SetupResult, TeacherResult


class TeacherWorker(Worker):
    """One rank of the teacher (see the module docstring); stages are driven by the step schedules."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        spec: TeacherSpec,
        client: DockChoice,
        num_threads: int | None = None,
    ):
        super().__init__(name, rank, world_size, num_threads)
        self.spec, self.client = spec, client
        self.tp, self.cp = spec.distill.tp, spec.distill.cp
        self.dp = world_size // (self.tp * self.cp)
        self.group_size = spec.samples_per_prompt
        self.temperature = spec.temperature if spec.temperature > 0 else 1.0
        self.multi_turn = spec.multi_turn

    def setup(self) -> SetupResult:
        """Build the sharded, frozen teacher (collective over the teacher's ranks)."""
        spec = self.spec
        path = spec.distill.teacher_path
        assert path is not None, "TeacherWorkers start only with distill.teacher_path set"
        self.teacher = TrainEngine(
            path,
            trainable=False,
            device=self.device,
            precision=spec.precision,
            mesh=training_mesh(self.device.type, self.dp, self.tp, self.cp),
        )
        tokenizer = Tokenizer.from_dir(spec.policy_path)  # the same ids as the teacher's (preflight checks)
        self.pad_token_id = first_token_id(tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
        # the cp x tp ranks of one dp rank score the same rows; their first rank talks to the dock
        self.dock = ReplicaClient(self.client, self.teacher.replica_group, self.rank, self.cp * self.tp)
        self.policy_vocab = read_config(spec.policy_path).vocab_size  # top-k ids are among the student's
        return SetupResult(self.teacher.args.num_params(), str(self.device), self.where())

    def score(self, dock: int | None = None) -> TeacherResult:
        """Serve the `teacher` consumer until every row of the step has teacher_logprobs; returns this rank's
        sums for the step's distill/* metrics (tp peers report none) and its busy time. `dock`: as
        RewardWorker.score."""
        if dock is not None:
            self.client.select(dock)
        n = self.group_size
        columns = [PROMPT_IDS, RESPONSE_IDS, ROLLOUT_LOGPROBS] + ([LOSS_MASK] if self.multi_turn else [])
        sums, rows_done, busy_s = DistillSums(), 0, 0.0
        while True:
            got = self.dock.get(
                Stage.TEACHER,
                columns,
                self.spec.groups_per_pull * n,
                whole_groups=True,
                min_count=n,
            )
            if not self._any_rank_has_rows(got is not None):
                break
            start = time.perf_counter()
            rows, batch = got if got is not None else ([], {c: [] for c in columns})
            logps, put = self._score(batch[PROMPT_IDS], batch[RESPONSE_IDS])
            if rows:
                self.dock.put(Stage.TEACHER, rows, put)
                masks = batch.get(LOSS_MASK) or [None] * len(rows)
                for teacher, student, mask in zip(logps, batch[ROLLOUT_LOGPROBS], masks):
                    sums.add(teacher, student, mask)
                rows_done += len(rows)
            busy_s += time.perf_counter() - start
        if not self.dock.is_head:  # cp and tp peers scored the same rows as their head
            return TeacherResult(0, DistillSums(), busy_s)
        return TeacherResult(rows_done, sums, busy_s)

    def _score(
        self, prompts: list[torch.Tensor], responses: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """The teacher's log-probs of the sampled tokens [R_i] per row, and the columns to put: those
        (teacher_logprobs), or with distill.top_k = k its top-k ids and log-probs [R_i, k]."""
        distill = self.spec.distill
        sizes = (distill.micro_batch_size, distill.max_tokens_per_micro_batch)
        if not distill.top_k:
            logps, _ = self.teacher.logprobs(
                prompts,
                responses,
                temperature=self.temperature,
                micro_batch_size=sizes[0],
                max_tokens_per_micro_batch=sizes[1],
                pad_token_id=self.pad_token_id,
            )
            return logps, {TEACHER_LOGPROBS: logps}
        logps, ids, top = self.teacher.top_k_logprobs(
            prompts,
            responses,
            distill.top_k,
            temperature=self.temperature,
            micro_batch_size=sizes[0],
            max_tokens_per_micro_batch=sizes[1],
            pad_token_id=self.pad_token_id,
            num_ids=self.policy_vocab,
        )
        return logps, {TEACHER_TOPK_IDS: ids, TEACHER_TOPK_LOGPROBS: top}

    def _any_rank_has_rows(self, has_rows: bool) -> bool:
        """Whether any data-parallel rank got rows this pull (all ranks then run the pull's forwards)."""
        group = self.teacher.dp_group
        if group is None or self.dp == 1:
            return has_rows
        flag = torch.tensor([int(has_rows)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


class TeacherGroup(WorkerGroup):
    """The teacher's ranks (TeacherWorkers in one process group), one typed method per stage."""

    worker = TeacherWorker

    def setup(self) -> Pending[SetupResult]:
        """Build the teacher on every rank."""
        return self.start(TeacherWorker.setup)

    def score(self, dock: int | None = None) -> Pending[TeacherResult]:
        """The teacher's log-probs of every row of the step (of dock `dock` in an asynchronous run)."""
        return self.start(TeacherWorker.score, dock)
