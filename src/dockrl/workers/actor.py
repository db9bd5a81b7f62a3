"""ActorWorker: one rank of the colocated actor (policy training + rollout + reference model).

Lifecycle of one RL step, every stage pulling its rows from the dock and pushing results back:

    setup ──▶ [generate ──▶ compute_ref ──▶ compute_old? ──▶ update] x steps ──▶ save
               │  sync weights (collective), then free-running: pull whole groups as they come,
               │  sample, put response_ids / rollout_logprobs; ends when the dock has no unserved rows
               compute_ref / compute_old / update: each rank pulls exactly rows/dp rows, so every rank
               runs the same number of FSDP forward/backward passes (FSDP collectives need lockstep)

With tensor parallel degree 1 every rank is the head of its own data-parallel group and talks to the dock.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dockrl.config.schema import TrainConfig
from dockrl.dock.client import DockClient
from dockrl.models.decoder import Transformer
from dockrl.models.hf import save_model
from dockrl.models.tokenizer import Tokenizer
from dockrl.parallel.dist import data_parallel_mesh
from dockrl.workers.group import Worker
from dockrl.workers.reshard.sync import copy_full_weights
from dockrl.workers.rollout.sampler import SamplingParams, generate
from dockrl.workers.train.engine import TrainEngine
from dockrl.workers.train.policy_update import policy_update

ROLLOUT = "rollout"
REF = "ref"
OLD = "old"
UPDATE = "update"


def row_seed(run_seed: int, step: int, row: int) -> int:
    """Per-row sampling seed: independent of which rank serves the row or what else is in its batch."""
    return (run_seed * 1_000_003 + step * 100_003 + row * 7919) % (2**63 - 1)


class ActorWorker(Worker):
    """Policy + reference + rollout model on one rank; stages are driven by the GRPO recipe."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        cfg: TrainConfig,
        client: DockClient,
        total_optimizer_steps: int,
        num_threads: int | None = None,
    ):
        super().__init__(name, rank, world_size, num_threads)
        self.cfg = cfg
        self.client = client
        self.total_optimizer_steps = total_optimizer_steps
        rows = cfg.run.prompts_per_step * cfg.rollout.samples_per_prompt
        self.rows_per_rank = rows // world_size
        self.on_policy = cfg.actor.mini_batches == 1 and cfg.actor.epochs == 1
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0

    def setup(self) -> dict[str, Any]:
        """Build the sharded policy (+ optimizer), the reference model and the rollout model."""
        cfg = self.cfg
        mesh = data_parallel_mesh(self.device.type, self.world_size)
        common = dict(device=self.device, precision=cfg.run.precision, mesh=mesh)
        self.policy = TrainEngine(
            cfg.model.path, optim=cfg.actor, total_optimizer_steps=self.total_optimizer_steps, **common
        )
        self.ref = None
        if cfg.algo.kl_coef > 0:
            self.ref = TrainEngine(cfg.model.ref_path or cfg.model.path, trainable=False, **common)
        dtype = torch.bfloat16 if cfg.run.precision == "bf16" else torch.float32
        with torch.device(self.device):
            self.rollout_model = Transformer(self.policy.args).to(dtype)
        self.rollout_model.requires_grad_(False).eval()
        self.rollout_stale = True
        self.tokenizer = Tokenizer.from_dir(cfg.model.path)
        self.pad_token_id = _first_id(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        self.stop_token_ids = _stop_ids(self.tokenizer.eos_token_id, self.policy.args.eos_token_id)
        return {
            "num_params": self.policy.args.num_params(),
            "device": str(self.device),
            "where": self.where(),
        }

    # ---- rollout -------------------------------------------------------------------------------

    def sync_rollout_weights(self) -> int:
        """Gather the training shards into the rollout model (collective: all ranks call it together)."""
        copied = copy_full_weights(self.policy.model, self.rollout_model)
        self.rollout_stale = False
        return copied

    def generate(self, step: int) -> dict[str, Any]:
        """Serve rollout rows from the dock until every row has a response."""
        if self.rollout_stale:
            self.sync_rollout_weights()
        roll = self.cfg.rollout
        params = SamplingParams(
            max_new_tokens=roll.max_new_tokens,
            temperature=roll.temperature,
            top_p=roll.top_p,
            top_k=roll.top_k,
            stop_token_ids=self.stop_token_ids,
        )
        group = roll.samples_per_prompt
        lengths, truncated = [], 0
        while True:
            got = self.client.get(
                ROLLOUT, ["prompt_ids"], roll.groups_per_pull * group, whole_groups=True, min_count=group
            )
            if got is None:
                break
            rows, batch = got
            prompts = [p.tolist() for p in batch["prompt_ids"]]
            seeds = [row_seed(self.cfg.run.seed, step, row) for row in rows]
            outs = generate(
                self.rollout_model,
                prompts,
                params,
                seeds,
                pad_token_id=self.pad_token_id,
                max_batch_size=roll.max_batch_size,
            )
            self.client.put(
                rows,
                {
                    "response_ids": [o.token_ids for o in outs],
                    "rollout_logprobs": [o.logprobs for o in outs],
                },
            )
            lengths += [len(o.token_ids) for o in outs]
            truncated += sum(o.finish_reason == "length" for o in outs)
        return {"response_lengths": lengths, "truncated": truncated}

    # ---- log-prob stages -----------------------------------------------------------------------

    def compute_ref(self) -> dict[str, Any]:
        """Reference-model log-probs of this rank's share of rows -> `ref_logprobs`."""
        return self._logprob_stage(REF, self.ref, "ref_logprobs")

    def compute_old(self) -> dict[str, Any]:
        """Current-policy log-probs before the update (needed when the update is off-policy) -> `old_logprobs`."""
        return self._logprob_stage(OLD, self.policy, "old_logprobs")

    def _logprob_stage(self, consumer: str, engine: TrainEngine, column: str) -> dict[str, Any]:
        rows, batch = self.client.get(consumer, ["prompt_ids", "response_ids"], self.rows_per_rank)
        logps, _ = engine.logprobs(
            batch["prompt_ids"],
            batch["response_ids"],
            temperature=self.temperature,
            micro_batch_size=self.cfg.actor.micro_batch_size,
            pad_token_id=self.pad_token_id,
        )
        self.client.put(rows, {column: logps})
        return {"rows": len(rows), "tokens": sum(len(r) for r in batch["response_ids"])}

    # ---- update --------------------------------------------------------------------------------

    def update(self) -> dict[str, float]:
        """Train on this rank's share of the step's rows: epochs x mini-batches optimizer steps."""
        actor, use_ref = self.cfg.actor, self.ref is not None
        columns = ["prompt_ids", "response_ids", "advantages"]
        columns += ["ref_logprobs"] if use_ref else []
        columns += [] if self.on_policy else ["old_logprobs"]
        rows, batch = self.client.get(UPDATE, columns, self.rows_per_rank)
        per_token_names = [c for c in columns if c not in ("prompt_ids", "response_ids")]
        mini_size = self.rows_per_rank // actor.mini_batches
        history: list[dict[str, float]] = []
        for _ in range(actor.epochs):
            for start in range(0, self.rows_per_rank, mini_size):
                idx = list(range(start, start + mini_size))
                history.append(
                    policy_update(
                        self.policy,
                        batch,
                        idx,
                        per_token_names,
                        self.cfg.algo,
                        temperature=self.temperature,
                        micro_batch_size=actor.micro_batch_size,
                        pad_token_id=self.pad_token_id,
                        world_size=self.world_size,
                    )
                )
        self.rollout_stale = True
        return {k: sum(h[k] for h in history) / len(history) for k in history[0]}

    # ---- checkpoints and evaluation ------------------------------------------------------------

    def save(self, path: str) -> str:
        """Write the policy as a Hugging Face directory (collective gather; rank 0 writes)."""
        state = self.policy.full_state_dict()
        if self.rank == 0:
            save_model(state, self.policy.args, path, tokenizer_dir=self.cfg.model.path)
        dist.barrier()
        return path

    def evaluate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy responses for held-out prompts with the current policy (this rank's share)."""
        if self.rollout_stale:
            self.sync_rollout_weights()
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=self.stop_token_ids
        )
        outs = generate(
            self.rollout_model,
            prompts,
            params,
            [0] * len(prompts),
            pad_token_id=self.pad_token_id,
            max_batch_size=self.cfg.rollout.max_batch_size,
        )
        return [o.token_ids.tolist() for o in outs]


def _first_id(*ids: Any) -> int:
    for i in ids:
        if isinstance(i, list):
            i = i[0] if i else None
        if i is not None:
            return int(i)
    raise AssertionError("unreachable: the last default is an int")


def _stop_ids(*ids: Any) -> list[int]:
    out: list[int] = []
    for i in ids:
        for j in i if isinstance(i, list) else [i]:
            if j is not None and int(j) not in out:
                out.append(int(j))
    return out
