"""Typed configs, the training side: what is trained and towards what objective. AdamW and its batching
(`OptimConfig`), the policy's training (`ActorConfig`, with its LoRA adapters and vision tower), the RL objective
(`AlgoConfig`), PPO's critic (`CriticConfig`) and on-policy distillation's teacher (`DistillConfig`). Each field
is documented once, here; `TrainConfig` and `SFTConfig` (schema.py) hold these sections, and dockrl.config.schema
re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dockrl.algos.registry import (
    PRESETS,
    Algorithm,
    KLControl,
    KLEstimator,
    LossAgg,
    LossNormalizer,
    RatioLevel,
    RolloutIS,
    estimator_names,
)
from dockrl.config.fields import setting
from dockrl.config.presets import AdvEstimator
from dockrl.models.families import ALL_LINEAR, LINEAR_NAMES

# actor.fsdp_unit_params' default: the measured point where grouping stops paying on this project's CPU hosts
# (docs/benchmarks.md, "FSDP2 units"): the 0.85M demo model is one unit (its update 1.2-1.45x faster at 2 ranks
# than with a unit per layer), the 28M bench model keeps a unit per layer (one unit: 1.16x slower, nothing
# overlapped), a real model's layer (>= ~10M) is never grouped.
FSDP_UNIT_PARAMS = 1_000_000

# The algorithm's closed choices (Algorithm, LossAgg, RatioLevel, LossNormalizer, KLEstimator, KLControl,
# RolloutIS) are declared in algos/registry.py; algo.adv_estimator accepts every registered estimator
# (config/presets.py).


@dataclass
class OptimConfig:
    """AdamW, its learning-rate schedule and the batching of one trained model (the actor's and the critic's
    settings inherit these; YAML keys stay flat: actor.lr, critic.lr, ...)."""

    lr: float = setting(1e-6, "Peak learning rate of AdamW.")
    min_lr_ratio: float = setting(1.0, "Cosine schedule floor as a fraction of `lr` (1.0: constant).")
    warmup_steps: int = setting(0, "Linear learning-rate warm-up optimizer steps.")
    weight_decay: float = setting(0.0, "AdamW weight decay.")
    adam_beta1: float = setting(0.9, "AdamW beta1.")
    adam_beta2: float = setting(0.999, "AdamW beta2.")
    adam_eps: float = setting(1e-8, "AdamW epsilon.")
    grad_clip: float = setting(1.0, "Clip the global gradient norm to this value; 0 turns clipping off.")
    micro_batch_size: int = setting(
        8,
        "Rows per forward/backward pass on one rank (gradient accumulation). The actor uses it only with "
        "actor.max_tokens_per_micro_batch=0: its token budget, when set, wins.",
    )
    mini_batches: int = setting(
        1, "Optimizer steps per RL step: the step's rows are split into this many mini-batches."
    )
    epochs: int = setting(1, "Passes over the step's rows. mini_batches=1 and epochs=1 is exactly on-policy.")
    activation_checkpointing: bool = setting(
        False,
        "Recompute each decoder layer's activations during the backward pass instead of keeping them: the "
        "update holds one layer's activations instead of every layer's (long responses fit), for about one "
        "more forward pass of compute; the numbers trained are the same.",
    )
    fsdp_unit_params: int = setting(
        FSDP_UNIT_PARAMS,
        "Smallest FSDP2 unit, in parameters: consecutive decoder layers are grouped in order until a group "
        "holds this many (each unit is one all-gather and one reduce-scatter per pass, and a point where the "
        "ranks wait for each other); layers after the last full group join the root unit (embedding, head). A "
        "model whose layers hold fewer in all is one unit; 0: a unit per layer. Only small models are "
        "grouped: a layer of a 0.5B model holds ~15M (docs/design.md, FSDP2 units).",
    )
    packing: bool = setting(
        True,
        "Padding-free micro-batches: the model computes each micro-batch's rows end to end (cumulative lengths, "
        "block-diagonal causal attention, positions restarting per row), so no padding token is computed in "
        "the update, reference, old log-prob and value passes; a token budget (max_tokens_per_micro_batch) then "
        "counts the rows' tokens. False: rows padded to the longest (the numbers agree to fp32 rounding). "
        "Under context parallelism (cp > 1) rows are padded whatever this says (each padded row is split).",
    )


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (docs/lora.md): adapters train, the base stays frozen."""

    rank: int = setting(
        0,
        "Adapter rank r; 0 trains every weight (full fine-tuning). With r > 0 only the adapters train (fp32, "
        "AdamW), the base is frozen in the compute dtype, and the KL reference is the base with the adapters "
        "off, or with model.lora_path's starting adapter (algo.kl_reference): no second copy of the model.",
    )
    alpha: float | None = setting(
        None, "Scale numerator: an adapter adds (alpha / rank) B A; None: 2 x rank."
    )
    dropout: float | None = setting(None, "Dropout on an adapter's input while training; None: 0.")
    target_modules: str | list[str] | None = setting(
        None,
        f"Linear layers that take adapters: {ALL_LINEAR} or a list of {', '.join(LINEAR_NAMES)}; None: "
        f"{ALL_LINEAR}.",
    )


@dataclass
class VisionConfig:
    """A vision-language policy's vision tower (qwen2_5_vl; docs/vision.md). Ignored for a text model."""

    freeze: bool = setting(
        True,
        "Keep the vision tower's weights as loaded: the update trains the language model (and the merger's "
        "input stays what the tower computes, without autograd). False: the tower trains with the language "
        "model (full fine-tuning only: with actor.lora.rank > 0 every base weight is frozen).",
    )


@dataclass
class ActorConfig(OptimConfig):
    """Training of the policy (and the colocated reference model)."""

    max_tokens_per_micro_batch: int = setting(
        4096,
        "Token budget of one forward/backward pass on one rank (update, reference and old log-probs): rows "
        "sorted by length, each micro-batch takes rows while rows x its longest row stays within it (a longer "
        "row goes alone), so like lengths share a pass and little padding is computed. 0: micro_batch_size "
        "rows per pass, in order.",
    )
    dp: int = setting(
        1,
        "Data-parallel degree of the actor: dp groups of ranks train on different rows. The actor has "
        "dp x cp x tp ranks (Ray actors); FSDP2 shards the parameters over dp x cp.",
    )
    cp: int = setting(
        1,
        "Context-parallel degree of training: each sequence of a micro-batch is split over cp ranks (2 cp "
        "zig-zag chunks, rank r holds chunks r and 2 cp - 1 - r), attention passes keys and values around the "
        "cp ranks (ring, online softmax), so activation memory per rank falls to about 1/cp (docs/design.md, "
        "context parallelism). Dense models; combines with dp, tp and LoRA.",
    )
    tp: int = setting(
        1,
        "Tensor-parallel degree of training (column/row-parallel linears, vocab-parallel embedding and LM "
        "head); must divide the model's num_heads, num_kv_heads (split, never replicated), vocab and MLP width.",
    )
    ep: int = setting(
        1,
        "Expert-parallel degree of training (MoE models): each rank holds num_experts / ep experts of every "
        "MoE layer; divides actor.dp and num_experts, with actor.tp=1 (docs/moe.md).",
    )

    moe_aux_loss_coef: float = setting(
        0.0,
        "MoE models: weight of the router's load-balancing loss (Switch/GShard, transformers' form, over each "
        "micro-batch's tokens) in the actor's loss; 0 logs it (moe/aux_loss) without training on it. The "
        "model's own router_aux_loss_coef (config.json) is what its pretraining used, e.g. 0.001.",
    )
    lora: LoraConfig = field(
        default_factory=LoraConfig, metadata={"doc": "LoRA adapters (rank 0: full fine-tuning)."}
    )
    vision: VisionConfig = field(
        default_factory=VisionConfig,
        metadata={"doc": "The vision tower of a vision-language policy (qwen2_5_vl)."},
    )


@dataclass
class AlgoConfig:
    """The RL objective."""

    name: Algorithm = setting(
        "grpo",
        f"Algorithm: {', '.join(PRESETS)} (docs/algorithms.md). A preset of the settings below left unset: "
        "one row of algos/registry.py (ppo's estimator, gae, runs a critic: see `critic`).",
        noun="algorithm",
    )
    adv_estimator: AdvEstimator | None = setting(
        None,
        "Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, none (opd's: no "
        "sequence advantage, the teacher's per-token term only), or gae (ppo's; needs the critic); None uses "
        "the algorithm's own (dapo and gspo use grpo's). An estimator registered in algos/ is a choice too.",
        noun="estimator",
        choices=estimator_names,
    )
    overlong_buffer_len: int = setting(
        0,
        "DAPO overlong shaping: the last this-many tokens before rollout.max_new_tokens get a linearly growing "
        "reward penalty; 0 turns shaping off.",
    )
    overlong_penalty: float = setting(
        1.0, "Penalty at (and beyond) rollout.max_new_tokens when overlong_buffer_len > 0."
    )
    clip_low: float | None = setting(
        None,
        "Lower clip of the importance ratio: 1 - clip_low. None: the algorithm's own (0.2; GSPO 3e-4). Clipping "
        "acts only off-policy: with actor.mini_batches=1 and actor.epochs=1 every ratio is exactly 1.",
    )
    clip_high: float | None = setting(
        None,
        "Upper clip of the importance ratio: 1 + clip_high. None: the algorithm's own (0.2; DAPO 0.28; GSPO 4e-4).",
    )
    kl_coef: float | None = setting(
        None,
        "Weight of the KL-to-reference term in the loss (with kl_in_reward: the initial coefficient of the KL "
        "penalty in the token rewards); 0 skips the reference model. None: the algorithm's own (0.001; DAPO, "
        "GSPO and Dr. GRPO 0, as their papers train without a reference model).",
    )
    kl_in_reward: bool = setting(
        False,
        "PPO and REINFORCE++: subtract kl_coef x the per-token KL of the sampling policy to the reference from "
        "the token rewards (before GAE / the returns and the step's whitening), instead of a KL term in the loss.",
    )
    kl_ctrl: KLControl = setting(
        "fixed",
        "KL coefficient controller for kl_in_reward: fixed, or adaptive (moves the coefficient towards "
        "kl_target, Ziegler et al. 2019).",
        noun="KL controller",
    )
    kl_target: float = setting(0.1, "Adaptive KL controller: target mean per-token KL of a step.")
    kl_horizon: int = setting(
        10000, "Adaptive KL controller: rows over which the coefficient moves by up to 20%."
    )
    gamma: float = setting(1.0, "PPO: discount of GAE over response tokens.")
    lam: float = setting(1.0, "PPO: lambda of GAE (1: Monte Carlo returns minus values, 0: one-step TD).")
    critic_warmup_steps: int = setting(
        0, "PPO: the first this-many RL steps train only the critic; the actor does not update."
    )
    routing_replay: Literal["none", "r3"] = setting(
        "none",
        "MoE models: r3 (rollout routing replay) makes the reference, old-log-prob and update passes use the "
        "experts the rollout routed each token to (weighted by the trainer's own router over them), so "
        "rollout and trainer compute the same experts where rounding makes their routers disagree; none lets "
        "the trainer route (moe/routing_agreement measures how often the two agree).",
        noun="routing replay",
    )
    rollout_is: RolloutIS = setting(
        "none",
        "Weight each token by w = exp(old - rollout log-prob), for a rollout policy that differs from the "
        "trainer's: tis truncates w at rollout_is_cap, decoupled masks tokens above it (docs/algorithms.md).",
        noun="correction",
    )
    rollout_is_cap: float = setting(2.0, "Cap of the importance weight of algo.rollout_is (>= 1).")
    old_logprobs: Literal["recompute", "rollout"] = setting(
        "recompute",
        "Where an off-policy update (several mini-batches or epochs, or rollout.max_staleness > 0) takes its old "
        "log-probs from: recompute (a forward pass of the policy before the update) or rollout (the log-probs "
        "the rollout engine computed while sampling: no extra pass; equal up to rounding in fp32, up to bf16 "
        "rounding otherwise, and for stale rows the behaviour policy itself).",
        noun="source",
    )
    kl_reference: Literal["adapter", "base"] = setting(
        "adapter",
        "LoRA with model.lora_path (a starting adapter, e.g. an SFT's): the KL reference is the base with that "
        "adapter, the policy the run starts from (adapter), or the base with the adapters off (base). Without "
        "model.lora_path the two are the same policy (fresh adapters add 0) and the base is used.",
        noun="KL reference",
    )
    kl_estimator: KLEstimator = setting(
        "k3",
        "KL estimator: k3 (unbiased, non-negative, low variance; the default), k2, or k1 (log-ratio: meant "
        "for the KL penalty in the reward; as a loss term its expected gradient is zero, which warns).",
        noun="estimator",
    )
    entropy_coef: float = setting(0.0, "Weight of the entropy bonus (subtracted from the loss).")
    loss_agg: LossAgg | None = setting(
        None,
        "Loss aggregation: token-mean, seq-mean-token-mean or seq-mean-token-sum. None: the algorithm's own "
        "(token-mean; GSPO seq-mean-token-mean; Dr. GRPO seq-mean-token-sum).",
        noun="aggregation",
    )
    ratio_level: RatioLevel | None = setting(
        None,
        "Importance ratio of the clipped surrogate: token (one ratio per token, PPO's) or sequence (one ratio "
        "per response, exp of the mean of its tokens' log-ratios, clipped per sequence: GSPO's). None: the "
        "algorithm's own (sequence for gspo, token for the rest).",
        noun="ratio level",
    )
    loss_normalizer: LossNormalizer | None = setting(
        None,
        "What divides each response's token sum in loss_agg=seq-mean-token-sum: tokens (nothing more: the "
        "aggregation's own), or max_new_tokens (the constant rollout.max_new_tokens, Dr. GRPO's: every token "
        "of every response weighs the same whatever the lengths). The other aggregations normalise by token "
        "counts themselves. None: the algorithm's own (max_new_tokens for dr_grpo, tokens for the rest).",
        noun="normaliser",
    )
    adv_eps: float = setting(1e-6, "Added to the group std when normalising advantages.")
    norm_adv_by_std: bool = setting(True, "Divide group-centred rewards by the group std (GRPO).")
    dynamic_sampling: bool = setting(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and generate more prompts until "
        "prompts_per_step groups with reward spread are found (or max_sampling_rounds run out).",
    )
    max_sampling_rounds: int = setting(
        3,
        "Most rollout rounds per step with dynamic_sampling; if they run out, zero-spread groups fill the "
        "batch (logged as dapo/filled_groups).",
    )


@dataclass
class CriticConfig(OptimConfig):
    """PPO's critic: a value model on its own ranks (CriticWorkers), trained with the clipped value loss."""

    lr: float = setting(
        1e-5, "Peak learning rate of AdamW (the critic's default is higher than the actor's)."
    )
    path: str | None = setting(
        None,
        "Initial critic weights: a causal-LM directory (its body, plus a fresh value head), a saved critic "
        "(RUN_DIR/checkpoints/step_NNNNNN/critic/hf), or a checkpoint root step_NNNNNN (its critic); None uses "
        "model.path.",
    )
    dp: int = setting(
        1,
        "Data-parallel degree of the critic: dp groups of ranks train on different rows. The critic has "
        "critic.dp x critic.cp ranks (its own Ray actors and process group, FSDP2 over all of them; one GPU each "
        "on run.device=cuda, besides the actor's).",
    )
    cp: int = setting(
        1,
        "Context-parallel degree of the critic: each sequence of its value and update passes is split over cp "
        "ranks as under actor.cp (zig-zag chunks, ring attention; every cp rank then holds the whole row's "
        "values), so activation memory per rank falls to about 1/cp. Dense models.",
    )
    value_clip: float | None = setting(
        0.2,
        "Clip of the value loss: a new value counts at most this far from the value that produced the "
        "advantages (the larger of the clipped and unclipped errors is used); None: plain squared error.",
    )


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a teacher model gives a log-prob for every token the policy
    sampled; each token's advantage gains distill.coef x (teacher log-prob - sampling log-prob), the negative
    per-token reverse KL to the teacher. algo.name=opd trains on that term alone. With distill.top_k = k > 0 the
    teacher gives its k most likely tokens at each position instead, and the loss gains distill.coef x the
    forward KL over them and the tail's mass."""

    teacher_path: str | None = setting(
        None,
        "The teacher: a Hugging Face causal-LM directory (or a dockrl checkpoint root) whose tokenizer has the "
        "policy's vocabulary (the same id for every token); None: no teacher (algo.name=opd needs one).",
    )
    coef: float = setting(
        1.0,
        "Weight of the teacher term in each token's advantage (added to the algorithm's own advantages; with "
        "algo.name=opd the whole advantage), or with distill.top_k > 0 of the top-k KL in the loss; 0 scores "
        "and logs distill/* without training on it.",
    )
    top_k: int = setting(
        0,
        "0: the sampled-token form (the teacher's log-prob of each sampled token, a term of the advantages). "
        "k > 0: the teacher's k most likely token ids and their log-probs at each response position go to the "
        "dock (k x 8 bytes per token), and the actor's loss adds distill.coef x the forward KL over those k "
        "tokens and the rest of the vocabulary as one outcome (docs/distillation.md).",
    )
    num_workers: int = setting(
        1,
        "TeacherWorker ranks, in one process group of their own: a (dp, cp, tp) grid, the teacher sharded over "
        "them with FSDP2 (distill.num_workers / distill.tp ways), tensor parallelism (distill.tp) and context "
        "parallelism (distill.cp); one GPU each on cuda.",
    )
    cp: int = setting(
        1,
        "Context-parallel degree of the teacher: each sequence of its forward passes is split over cp ranks as "
        "under actor.cp (zig-zag chunks, ring attention), so activation memory per rank falls to about 1/cp; "
        "distill.cp x distill.tp must divide distill.num_workers. Dense teachers.",
    )
    tp: int = setting(
        1,
        "Tensor-parallel degree of the teacher; must divide distill.num_workers and the teacher's heads, "
        "key-value heads, vocabulary and MLP width.",
    )
    max_tokens_per_micro_batch: int = setting(
        4096,
        "Token budget of one teacher forward pass (as actor.max_tokens_per_micro_batch: rows sorted by length, "
        "each pass takes rows while rows x its longest row fits); 0: distill.micro_batch_size rows per pass.",
    )
    micro_batch_size: int = setting(
        8, "Sequences per teacher forward pass when distill.max_tokens_per_micro_batch is 0."
    )
