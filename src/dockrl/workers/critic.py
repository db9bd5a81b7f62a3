"""CriticWorker: one data-parallel rank of PPO's critic, a value model (`models.value`) with its own AdamW.

Placement: the critic runs on its own Ray actors (`critic.dp` x `critic.cp` ranks in their own process group, a
(dp, cp) grid, FSDP2 over all of them; one GPU each on cuda, besides the actor's), so its stages overlap the
actor's. With critic.cp > 1 the cp ranks of a dp rank read the same rows (their first rank talks to the dock) and
split each sequence (parallel/context.py: ring attention; every cp rank gets the whole grid of values, and the
loss, computed alike on each, is scaled by dp x cp as FSDP2 averages over those ranks). Lifecycle of one RL step,
every stage pulling exactly rows/dp rows from the dock (length-balanced, so the FSDP ranks stay in lockstep):

    setup(resume_from?) ──▶ [compute_values ──▶ update ──▶ save?] x steps
               │                  │
               │                  pull reward, update_weight, values [, ref_logprobs, old_logprobs] ─▶ token
               │                  rewards (the sequence reward on the last token, minus kl_coef x per-token KL
               │                  with algo.kl_in_reward) ─▶ GAE ─▶ put advantages, returns ─▶ epochs x
               │                  mini-batches of clipped value loss on the same rows, rows of update_weight 0
               │                  masked out (the actor's update, waiting for `advantages`, runs meanwhile and
               │                  whitens them over every token of the step)
               pull prompt_ids, response_ids ─▶ V(state before each response token) ─▶ put values

Shapes: B rows, T tokens of a micro-batch (shifted grid T-1, see engines.train.batch).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dockrl.algos.advantages import gae_advantages
from dockrl.algos.losses import kl_penalty, masked_mean, value_clip_frac, value_loss
from dockrl.algos.ppo import (
    KLController,
    explained_variance,
    explained_variance_moments,
    pad_rows,
    token_level_rewards,
)
from dockrl.checkpoint.directory import CRITIC, HF
from dockrl.checkpoint.sharded import export_hf, load_engine, save_engine
from dockrl.config.specs import CriticSpec
from dockrl.config.step_plan import StepPlan
from dockrl.dock.api import DockAPI
from dockrl.dock.choice import DockChoice
from dockrl.dock.columns import (
    ADVANTAGES,
    OLD_LOGPROBS,
    PROMPT_IDS,
    REF_LOGPROBS,
    RESPONSE_IDS,
    RETURNS,
    REWARD,
    UPDATE_WEIGHT,
    VALUES,
)
from dockrl.dock.stages import Stage
from dockrl.engines.train.batch import MicroBatch, make_micro_batch, split_indices
from dockrl.engines.train.policy_update import all_reduce_sum
from dockrl.engines.train.train_engine import TrainEngine
from dockrl.models.value import value_model_kind
from dockrl.parallel.dist import data_parallel_mesh, training_mesh
from dockrl.parallel.replica import ReplicaClient
from dockrl.workers.group import Pending, Worker, WorkerGroup
from dockrl.workers.results import CriticState, LogprobResult, SetupResult, UpdateResult

# Right padding never reaches a real token (causal attention) and padded values are dropped: any id will do.
PAD_TOKEN_ID = 0
# Summed over micro-batches and ranks; each is already weighted by its share of the mini-batch's tokens.
SUMMED_METRICS = ("value_loss", "value_clipfrac", "vpred_mean")


class CriticWorker(Worker):
    """Value model on one critic rank; stages are driven by the GRPO recipe when the plan runs a critic (ppo)."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        *,
        spec: CriticSpec,
        plan: StepPlan,
        client: DockChoice,
        num_threads: int | None = None,
    ):
        """`spec` and `plan`: the critic's spec and the run's step plan (config.specs), read, never changed."""
        super().__init__(name, rank, world_size, num_threads)
        self.spec, self.plan, self.client = spec, plan, client
        self.rows = spec.rows_per_step
        self.cp = spec.optim.cp
        self.dp = world_size // self.cp  # context-parallel peers train on the same rows
        self.rows_per_rank = self.rows // self.dp
        self.dock: DockAPI | DockChoice = client
        # Every rank sees the same all-reduced KL each step, so their controllers stay identical.
        algo = spec.algo
        self.kl_ctrl = KLController(
            algo.kl_ctrl, plan.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon
        )

    def setup(self, resume_from: str | None = None, kl_coef: float | None = None) -> SetupResult:
        """Build the sharded value model and its optimizer; with `resume_from` (a checkpoint root) both come
        from there, and the KL controller continues from `kl_coef`."""
        spec = self.spec
        if kl_coef is not None:
            self.kl_ctrl.value = kl_coef
        self.engine = TrainEngine(
            spec.path,
            kind=value_model_kind(spec.seed),
            device=self.device,
            precision=spec.precision,
            mesh=(
                data_parallel_mesh(self.device.type, self.dp)
                if self.cp == 1
                else training_mesh(self.device.type, self.dp, 1, self.cp)
            ),
            optim=spec.optim,
            total_optimizer_steps=spec.total_optimizer_steps,
            load_weights=resume_from is None,
            packing=spec.optim.packing,
            fsdp_unit_params=spec.optim.fsdp_unit_params,
        )
        if resume_from is not None:
            load_engine(self.engine, Path(resume_from) / CRITIC)
        if self.cp > 1:  # the cp ranks of one dp rank read the same rows; their first rank talks to the dock
            self.dock = ReplicaClient(self.client, self.engine.replica_group, self.rank, self.cp)
        num_params = sum(p.numel() for p in self.engine.model.parameters())
        return SetupResult(num_params, str(self.device), self.where())

    def compute_values(self) -> LogprobResult:
        """Values of this rank's share of rows -> `values` [R] per row."""
        got = self.dock.get(
            Stage.CRITIC_VALUES,
            [PROMPT_IDS, RESPONSE_IDS],
            self.rows_per_rank,
            balance_over=self.dp,
            peer=self.engine.dp_rank,
        )
        assert got is not None, "the dock had no rows left for this critic rank"
        rows, batch = got
        self.dock.put(
            Stage.CRITIC_VALUES, rows, {VALUES: self._values(batch[PROMPT_IDS], batch[RESPONSE_IDS])}
        )
        return LogprobResult(len(rows), sum(len(r) for r in batch[RESPONSE_IDS]))

    @torch.no_grad()
    def _values(self, prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> list[torch.Tensor]:
        self.engine.model.eval()
        values: list[torch.Tensor] = []
        for idx in split_indices(len(prompts), self.spec.optim.micro_batch_size):
            mb = make_micro_batch(
                [prompts[i] for i in idx],
                [responses[i] for i in idx],
                pad_token_id=PAD_TOKEN_ID,
                device=self.engine.device,
                packed=self.engine.packing,
            )
            values += mb.unpad(self.engine.logits(mb))  # [B, T-1] values on the shifted grid
        return values

    def update(self) -> UpdateResult:
        """GAE advantages and returns of this rank's rows into the dock, then the critic's optimizer steps.

        Returns metrics of the whole step (all ranks): `critic/...`, and with algo.kl_in_reward the KL in the
        reward and the coefficient it was weighted with (then adapted for the next step by the controller).
        """
        algo = self.spec.algo
        columns = [PROMPT_IDS, RESPONSE_IDS, UPDATE_WEIGHT, REWARD, VALUES]
        columns += [REF_LOGPROBS, OLD_LOGPROBS] if algo.kl_in_reward else []
        got = self.dock.get(
            Stage.CRITIC_UPDATE, columns, self.rows_per_rank, balance_over=self.dp, peer=self.engine.dp_rank
        )
        assert got is not None, "the dock had no rows left for this critic rank"
        rows, batch = got
        start = time.perf_counter()
        values, mask = pad_rows(batch[VALUES])  # [B, R] over this rank's rows
        # Rows a failed reward call left out (reward.on_error=drop_group) weigh 0, as in the actor's update:
        # their GAE is computed (rows are independent) but they enter no loss, figure or KL controller.
        counted = mask * _row_weights(batch)[:, None]  # [B, R] float
        kl = None
        if algo.kl_in_reward:
            old, ref = pad_rows(batch[OLD_LOGPROBS])[0], pad_rows(batch[REF_LOGPROBS])[0]
            kl = kl_penalty(old, ref, algo.kl_estimator)  # [B, R]
        scores = torch.tensor([float(r) for r in batch[REWARD]])
        kl_coef = self.kl_ctrl.value
        rewards = token_level_rewards(scores, mask, kl, kl_coef)  # [B, R]
        advantages, returns = gae_advantages(rewards, values, mask, gamma=algo.gamma, lam=algo.lam)
        lengths = [len(v) for v in batch[VALUES]]
        batch[RETURNS] = [returns[i, :n].clone() for i, n in enumerate(lengths)]
        row_advantages = [advantages[i, :n].clone() for i, n in enumerate(lengths)]
        self.dock.put(Stage.CRITIC_UPDATE, rows, {ADVANTAGES: row_advantages, RETURNS: batch[RETURNS]})
        metrics = self._step_stats(values, returns, advantages, counted, kl, kl_coef)
        if kl is not None:
            self.kl_ctrl.update(metrics["reward/kl_penalty"], self.rows)
        history = [
            self._train_mini_batch(batch, idx)
            for _ in range(self.spec.optim.epochs)
            for idx in _mini_batches(self.rows_per_rank, self.spec.optim.mini_batches)
        ]
        for key in history[0]:
            metrics[f"critic/{key}"] = sum(h[key] for h in history) / len(history)
        metrics["critic/update_s"] = time.perf_counter() - start
        return UpdateResult(metrics)

    def _step_stats(
        self,
        values: torch.Tensor,
        returns: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        kl: torch.Tensor | None,
        kl_coef: float,
    ) -> dict[str, float]:
        """Whole-step figures before training (all [B, R] in): explained variance, means of values, returns,
        advantages and the KL in the reward, summed over the critic ranks. `mask`: 1 where a token counts (0 on
        padding and on rows left out of the update), float or bool."""
        mask_f = mask.double()
        sums = [mask_f.sum(), (values * mask_f).sum(), (returns * mask_f).sum(), (advantages * mask_f).sum()]
        sums.append((kl * mask_f).sum() if kl is not None else mask_f.new_zeros(()))
        local = torch.cat([torch.stack(sums).double(), explained_variance_moments(values, returns, mask)])
        total = all_reduce_sum(local, self.engine.dp_group)
        tokens = max(total[0].item(), 1.0)
        metrics = {
            "critic/explained_variance": explained_variance(total[5:]),
            "critic/values_mean": total[1].item() / tokens,
            "critic/returns_mean": total[2].item() / tokens,
            "critic/advantages_mean": total[3].item() / tokens,  # before the actor whitens them
        }
        if kl is not None:
            metrics["reward/kl_penalty"] = total[4].item() / tokens  # mean per-token KL in the reward
            metrics["reward/kl_coef"] = kl_coef
        return metrics

    def _train_mini_batch(self, batch: dict[str, list], idx: list[int]) -> dict[str, float]:
        """One critic optimizer step on rows `idx`: token-mean clipped value loss over the mini-batch (all ranks);
        rows of weight 0 are masked out of the loss and its token count."""
        weights = _row_weights(batch)[idx].tolist()
        local_tokens = sum(len(batch[VALUES][i]) * w for i, w in zip(idx, weights))
        global_tokens = all_reduce_sum(torch.tensor([float(local_tokens)]), self.engine.dp_group)[0].item()
        global_tokens = max(global_tokens, 1.0)  # every row left out: a zero loss
        micro_batches = [
            make_micro_batch(
                [batch[PROMPT_IDS][idx[j]] for j in chunk],
                [batch[RESPONSE_IDS][idx[j]] for j in chunk],
                pad_token_id=PAD_TOKEN_ID,
                device=self.engine.device,
                per_token={name: [batch[name][idx[j]] for j in chunk] for name in (VALUES, RETURNS)},
                response_masks=[torch.full((len(batch[VALUES][idx[j]]),), weights[j]) for j in chunk],
                packed=self.engine.packing,
            )
            for chunk in split_indices(len(idx), self.spec.optim.micro_batch_size)
        ]
        clip, world = self.spec.optim.value_clip, self.world_size

        def loss_fn(vpred: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
            old, returns, mask = mb.per_token[VALUES], mb.per_token[RETURNS], mb.response_mask  # [B, T-1]
            loss = value_loss(vpred, old, returns, mask, clip=clip, num_tokens=global_tokens)
            share = mask.sum().item() / global_tokens  # weight of this micro-batch's token means
            clipfrac = (
                value_clip_frac(vpred, old, returns, mask, clip=clip).item() if clip is not None else 0.0
            )
            metrics = {
                "value_loss": loss.item(),
                "value_clipfrac": clipfrac * share,
                "vpred_mean": masked_mean(vpred.detach(), mask).item() * share,
            }
            return loss * world, metrics  # FSDP2 averages gradients over the dp x cp ranks

        metrics = self.engine.train_step(micro_batches, loss_fn)
        totals = torch.tensor([metrics[k] for k in SUMMED_METRICS], dtype=torch.float64)
        out = dict(zip(SUMMED_METRICS, all_reduce_sum(totals, self.engine.dp_group).tolist()))
        out["grad_norm"], out["lr"] = metrics["grad_norm"], metrics["lr"]
        return out

    def save(self, path: str) -> CriticState:
        """Write the critic's training state to `path`/critic and its model directory (body + `score` head,
        which `critic.path` loads) to `path`/critic/hf (collective); returns the KL controller's state."""
        save_engine(self.engine, Path(path) / CRITIC)
        export_hf(self.engine, Path(path) / CRITIC / HF, tokenizer_dir=self.spec.tokenizer_path)
        return CriticState(self.kl_ctrl.value)


def _row_weights(batch: dict[str, list]) -> torch.Tensor:
    """update_weight of each row [B] fp32: 1, or 0 for a row the update leaves out."""
    return torch.tensor([float(w) for w in batch[UPDATE_WEIGHT]], dtype=torch.float32)


def _mini_batches(num_rows: int, num_mini_batches: int) -> list[list[int]]:
    size = num_rows // num_mini_batches
    return [list(range(start, start + size)) for start in range(0, num_rows, size)]


class CriticGroup(WorkerGroup):
    """PPO's critic ranks (CriticWorkers in their own process group), one typed method per stage."""

    worker = CriticWorker

    def setup(self, resume_from: str | None = None, kl_coef: float | None = None) -> Pending[SetupResult]:
        """Build the value model (from checkpoint `resume_from`, KL coefficient `kl_coef`, when given)."""
        return self.start(CriticWorker.setup, resume_from, kl_coef)

    def compute_values(self) -> Pending[LogprobResult]:
        """Values of every row."""
        return self.start(CriticWorker.compute_values)

    def update(self) -> Pending[UpdateResult]:
        """GAE advantages into the dock, then the critic's optimizer steps."""
        return self.start(CriticWorker.update)

    def save(self, path: str) -> Pending[CriticState]:
        """Write the critic's part of the checkpoint at `path`."""
        return self.start(CriticWorker.save, path)
