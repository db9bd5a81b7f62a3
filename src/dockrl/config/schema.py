"""Typed configs for every dockrl job. Each field is documented once, here.

A job config is a tree of dataclasses: `TrainConfig` for `dockrl train` (GRPO), `SFTConfig` for `dockrl sft`.
Load one from YAML with dotted overrides via `dockrl.config.load_config`; validation (`validate_train`,
`validate_sft`) runs before Ray or any process starts.
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
from dockrl.backends.vllm import VllmConfig
from dockrl.config.fields import required, setting
from dockrl.config.presets import AdvEstimator
from dockrl.models.families import ALL_LINEAR, FAMILIES, LINEAR_NAMES

# Closed choices: a value outside them is an error listing them (config.loader). The algorithm's (Algorithm,
# LossAgg, RatioLevel, LossNormalizer, KLEstimator, KLControl, RolloutIS) are declared in algos/registry.py;
# algo.adv_estimator accepts every registered estimator (config/presets.py).
DockMode = Literal["dock", "single", "driver"]
DockTransport = Literal["socket", "ray"]
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["auto", "fp32", "bf16"]


@dataclass
class ModelConfig:
    """The policy model."""

    path: str = required(
        "Hugging Face checkpoint directory (config.json, *.safetensors, single or sharded, and tokenizer "
        "files), or a dockrl checkpoint root RUN_DIR/checkpoints/step_NNNNNN (its hf/ export is loaded)."
    )
    ref_path: str | None = setting(
        None,
        "Reference model directory for the KL term; None uses `model.path`, or, when `model.path` is a "
        "checkpoint root, the reference that checkpoint's run used (the KL reference never moves silently).",
    )
    lora_path: str | None = setting(
        None,
        "A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start the actor's "
        "adapters from; its rank, alpha and targets are the run's (actor.lora keys left unset or equal).",
    )


@dataclass
class DataConfig:
    """Prompt datasets."""

    train_path: str = required("Training prompts: a .jsonl, .json (json lines) or .parquet file.")
    prompt_field: str = setting(
        "prompt", "Field holding the prompt: a string or a list of chat messages {role, content}."
    )
    label_field: str = setting(
        "answer", "Field holding the ground truth passed to reward functions as `label`."
    )
    eval_path: str | None = setting(
        None,
        "Held-out prompts (optional): `dockrl train` scores greedy answers, `dockrl sft` reports the teacher-"
        "forced answer loss and token accuracy at the end.",
    )
    eval_limit: int | None = setting(None, "Score at most this many held-out prompts.")
    system_prompt: str | None = setting(None, "System message prepended to every prompt.")
    use_chat_template: bool = setting(
        True, "Render prompts with the tokenizer's chat template (False: the raw prompt text)."
    )
    max_prompt_len: int = setting(
        512, "Prompts longer than this many tokens are skipped (counted in the log)."
    )
    shuffle: bool = setting(True, "Shuffle the training prompts each epoch (seeded by `run.seed`).")
    tools: list[str] = setting(
        [],
        "dockrl sft on tool-use conversations: built-in tools (calculator, python) whose schemas the chat "
        "template renders into each prompt, as env.name=tools does in `dockrl train`.",
    )


@dataclass
class RolloutConfig:
    """Generation of responses by the actor's rollout engine."""

    samples_per_prompt: int = setting(8, "Responses generated per prompt (the GRPO group size).")
    max_new_tokens: int = setting(256, "Maximum response length in tokens.")
    temperature: float = setting(1.0, "Sampling temperature; 0 is greedy. The trainer uses the same value.")
    top_p: float = setting(
        1.0,
        "Nucleus sampling: keep the smallest token set with this probability mass. Like top_k and min_p it "
        "filters what is sampled only: the rollout's log-probs are the model's at the temperature over the whole "
        "vocabulary, on either backend (vLLM: exactly at temperature 1; docs/vllm.md, which log-probs).",
    )
    top_k: int = setting(0, "Keep only the k most likely tokens; 0 turns it off.")
    min_p: float = setting(
        0.0, "Keep only tokens with probability >= min_p x the most likely token's; 0 turns it off."
    )
    stop_strings: list[str] = setting(
        [], "A response ends with the token that completes one of these strings (besides the EOS token)."
    )
    max_batch_size: int = setting(
        256,
        "Sequence slots of the rollout engine: most sequences one rank decodes at once (continuous "
        "batching).",
    )
    kv_cache: Literal["auto", "slots", "paged"] = setting(
        "auto",
        "Layout of dockrl's rollout KV cache (backend dockrl). slots: every slot's worst case, max_batch_size x "
        "(data.max_prompt_len + max_new_tokens) positions, allocated up front and read in place (the fastest "
        "decode). paged: blocks of 32 positions handed out as sequences grow, up to kv_cache_tokens (memory "
        "by use; each decode step gathers the keys it reads). auto: slots when they fit kv_cache_tokens, "
        "paged when they do not.",
    )
    kv_cache_tokens: int = setting(
        0,
        "Positions dockrl's rollout KV cache may hold over all its sequences (backend dockrl). 0: no bound "
        "(max_batch_size x (data.max_prompt_len + max_new_tokens), every slot's worst case). Below that, "
        "kv_cache=auto takes the paged layout: the cache grows to this by doubling, and new sequences wait, "
        "and the youngest is preempted and restarted, when its blocks run out; it must hold one whole sequence.",
    )
    keep_kv_across_turns: bool = setting(
        True,
        "Multi-turn (env.name, backend dockrl): a trajectory's KV stays in the cache while its environment "
        "runs, so its next turn prefills only the new tokens (the observation) instead of its whole prefix. "
        "Kept KV only takes room nothing else needs: a new sequence that needs it takes it (oldest first), and "
        "that trajectory's next turn re-prefills. false: every turn re-prefills.",
    )
    pack_weights: bool = setting(
        True,
        "dockrl engine on a CPU: its linear weights are laid out once per weight update in oneDNN's blocked "
        "format (bf16) and q/k/v and gate/up run as one matmul each, so a decode step makes 4 matmul calls per "
        "layer instead of 7 (models/packed_linear.py; same tokens and log-probs, one more copy of the weights "
        "while it decodes; 1.25x decode at 8 rows per rank). false: the model's own modules.",
    )
    groups_per_pull: int = setting(4, "Prompt groups a rollout rank pulls from the dock at a time.")
    tp: int = setting(
        1,
        "Tensor-parallel degree of the rollout: actor.dp x actor.cp x actor.tp / rollout.tp replicas, each serving its "
        "own rows (its first rank talks to the dock). Must divide the actor's ranks and the model's heads.",
    )
    placement: Literal["colocated", "separate"] = setting(
        "colocated",
        "colocated: the actor's ranks switch between training and rollout (allgather-swap); separate: "
        "rollout.replicas rollout ranks of their own (Ray actors; one GPU each on cuda) generate, and receive "
        "the trainer's weights after each update, broadcast bucket by bucket (rollout.tp=1 so far).",
        noun="placement",
    )
    replicas: int = setting(1, "Rollout replicas with rollout.placement=separate (each its own Ray actor).")
    max_staleness: int = setting(
        0,
        "Policy versions the rollout may run behind the update (0: synchronous, on-policy; k >= 1 with "
        "rollout.placement=separate: the next k steps generate while this one trains; see docs/async.md).",
    )
    partial: bool = setting(
        False,
        "Partial rollout: responses get rollout.partial_tokens new tokens per step, and the groups cut there "
        "continue in later steps, at most rollout.max_staleness times (docs/async.md).",
    )
    partial_tokens: int = setting(
        0, "Tokens per response per step with rollout.partial (0: rollout.max_new_tokens / 4, at least 1)."
    )
    backend: str = setting(
        "dockrl",
        "The generation engine, a name of the backend registry (backends): dockrl (its own "
        "continuous-batching engine, every device) or vllm (vLLM 0.32.0 in process; see docs/vllm.md).",
        noun="backend",
    )
    vllm: VllmConfig = field(default_factory=VllmConfig)  # rollout.backend=vllm's section


@dataclass
class ReshardConfig:
    """The switch between the training layout and the rollout layout (allgather-swap)."""

    bucket_mb: float | None = setting(
        None,
        "Most MiB of rollout weights per gather buffer; must be >= the largest tensor. None: the largest "
        "tensor's size (the lowest peak).",
    )
    offload_optimizer: bool | None = setting(
        None, "Move optimizer state to host memory during rollout; None: on with run.device=cuda."
    )
    offload_grads: bool | None = setting(
        None, "Free gradients during rollout (they are rebuilt by the next backward); None: on with cuda."
    )
    offload_params: bool | None = setting(
        None,
        "Move training (and reference) parameters to host memory during rollout; None: on with cuda.",
    )
    free_kv_cache: bool | None = setting(
        None,
        "Free the rollout KV cache while training (it holds no state between steps and is allocated again "
        "at the next rollout); None: on with cuda.",
    )


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
class RewardFnConfig:
    """One reward function and its weight."""

    name: str = required(
        "A built-in (exact_answer, math_verify, format), `package.module:function`, or a file "
        "`path/to/file.py:function` (relative to the config file's directory, then the working directory; a "
        "`module:function` whose module.py lies there works too): its source is read when the config is loaded "
        "and shipped to every reward worker and process, so it need not be on PYTHONPATH or on other nodes."
    )
    weight: float = setting(1.0, "Weight of this function's score in the total reward.")
    kwargs: dict = setting({}, "Keyword arguments passed to the function.")
    source_file: str | None = setting(
        None,
        "Filled in when the config is loaded: the file a file-given function was read from (leave unset).",
    )
    code: str | None = setting(
        None,
        "Filled in when the config is loaded: that file's source, recorded in the run's config (leave unset).",
    )


@dataclass
class RewardModelConfig:
    """A reward model scored by RewardModelWorkers; its weighted score joins the rule rewards."""

    path: str | None = setting(
        None,
        f"Hugging Face {' / '.join(f.seq_cls for f in FAMILIES.values() if f.seq_cls)} directory with "
        "num_labels=1 and its tokenizer (`dockrl make-tiny DIR --reward-model` builds a tiny one); None: no "
        "reward model.",
    )
    weight: float = setting(1.0, "Weight of the model's score in the total reward (stored as `reward/rm`).")
    num_workers: int = setting(
        1, "RewardModelWorker actors, each with the whole model (one GPU each on run.device=cuda)."
    )
    micro_batch_size: int = setting(8, "Sequences (prompt + response) per forward pass of the reward model.")


@dataclass
class RewardConfig:
    """Reward computation (CPU RewardWorkers, and RewardModelWorkers when `reward.model.path` is set)."""

    functions: list[RewardFnConfig] = field(
        default_factory=lambda: [RewardFnConfig(name="exact_answer")],
        metadata={
            "doc": "Reward functions; the total reward is their weighted sum (plus reward.model.weight x the "
            "reward model's score). May be [] when reward.model.path is set."
        },
    )
    model: RewardModelConfig = field(
        default_factory=RewardModelConfig,
        metadata={"doc": "Reward model (off unless reward.model.path is set)."},
    )
    num_workers: int = setting(1, "RewardWorker actors; each pulls whole groups from the dock.")
    num_processes: int = setting(
        1, "Processes per RewardWorker that run reward calls; 0 runs them inline (no timeout)."
    )
    inline: Literal["cheap", "all", "none"] = setting(
        "cheap",
        "Which reward functions run in the RewardWorker's own thread instead of its process pool (no pipe round "
        "trip per call): cheap, the built-ins that are pure Python and fast (exact_answer; format with its own "
        "pattern, not a configured one, which could backtrack for ever) and user functions that declare "
        "`fn.cheap = True`; all, every function; none, none. An inline call past reward.timeout_s stops the run "
        "with an error naming the function (a thread cannot be killed; a call stuck in C code that holds the GIL "
        "is not bounded at all): a function that can hang belongs in the pool.",
        noun="mode",
    )
    timeout_s: float = setting(
        5.0,
        "A reward call running longer is stopped and counted in `reward/timeouts`; reward.on_error says what "
        "its row then counts as. A timeout depends on wall time: a run is repeatable bit for bit only while "
        "reward/timeouts stays 0.",
    )
    on_error: Literal["zero", "drop_group"] = setting(
        "drop_group",
        "A reward call that timed out or raised: drop_group leaves the row's whole group out of the update "
        "(its tokens are masked out of the loss; counted in reward/dropped_groups), so a failure never counts "
        "as a wrong answer in its group's statistics; zero scores the call 0 and keeps the group.",
        noun="policy",
    )
    groups_per_pull: int = setting(
        4, "Groups a RewardWorker (and a RewardModelWorker) pulls from the dock at a time."
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


@dataclass
class DockConfig:
    """The transfer dock: one controller (metadata) and warehouses (payload)."""

    num_warehouses: int | None = setting(None, "Warehouse actors; None means one per Ray node.")
    get_timeout_s: float = setting(
        600.0, "A dock read waiting longer raises an error naming the consumer and the ready counts."
    )
    mode: DockMode = setting(
        "dock",
        "dock (controller + warehouses, payload worker to worker), single (one replay-buffer actor holds "
        "data and metadata) or driver (all payload through the driver); the last two are baselines.",
        noun="dock mode",
    )
    transport: DockTransport = setting(
        "socket",
        "How dock mode's clients reach the controller and warehouses: socket (a direct connection to each "
        "actor, the fast path) or ray (Ray actor calls; payload through Ray's object store).",
        noun="transport",
    )
    policy: str = setting(
        "first",
        "Which ready rows a consumer gets first: first (lowest row ids), oldest (rows carried over by "
        "partial rollout first), local (rows held on the consumer's node first; see docs/design.md#the-dock), "
        "or a function 'module:function' (see dockrl/dock/policies.py).",
    )
    max_rows: int | None = setting(
        None, "Rows the table may hold (unfinished rows carried over + the step's new rows); None: no limit."
    )


@dataclass
class RunConfig:
    """The run: steps, resources, outputs."""

    steps: int = required("RL steps to run.")
    prompts_per_step: int = required(
        "Prompts per RL step; rows per step = prompts_per_step x samples_per_prompt."
    )
    seed: int = setting(0, "Seed for data order, initialisation and sampling (per-row seeds derive from it).")
    output_dir: str = setting("runs", "Parent directory of run directories.")
    name: str | None = setting(None, "Run directory name; None uses a timestamp.")
    save_every: int = setting(
        0,
        "Write a resumable checkpoint every this many steps and at the end (0: only at the end): "
        "RUN_DIR/checkpoints/step_NNNNNN/ with the sharded training state of the actor (and critic), a Hugging "
        "Face export in hf/ and trainer_state.json. `model.path`, `critic.path` and `dockrl eval --model` take "
        "such a checkpoint root as well as a Hugging Face directory.",
    )
    keep_checkpoints: int | None = setting(
        None,
        "Keep at most this many checkpoints (the newest); an old one is deleted only after a new one is "
        "complete. None keeps all.",
    )
    resume: str = setting(
        "never",
        "never; auto (continue from the newest complete checkpoint in the run directory, or start fresh when "
        "there is none); or the path of a checkpoint root (RUN_DIR/checkpoints/step_NNNNNN). A resumed run "
        "reproduces the uninterrupted one exactly (docs/checkpoints.md).",
    )
    resume_force: bool = setting(
        False, "Resume even though settings that change the computation differ from the checkpoint's."
    )
    max_restarts: int = setting(
        0,
        "When a worker dies or hangs, stop every worker and the dock, start them again and resume from the "
        "newest checkpoint, at most this many times per run (logged as run/restarts).",
    )
    heartbeat_timeout_s: float = setting(
        30.0,
        "A worker or dock actor that answers no heartbeat for this long is hung: the run stops with an error "
        "naming it (or restarts, see max_restarts).",
    )
    eval_every: int = setting(0, "Evaluate on `data.eval_path` every this many steps (0: only at the end).")
    log_samples: int = setting(4, "Prompt/response/reward triples written to samples.jsonl per step.")
    loggers: list[str] = setting(
        ["jsonl"],
        "Where each step's metrics and samples go: jsonl (metrics.jsonl and samples.jsonl, always on), "
        "tensorboard (event files in RUN_DIR/tensorboard/; `tensorboard --logdir runs`), wandb (project "
        "WANDB_PROJECT or dockrl; WANDB_MODE=offline keeps it in RUN_DIR/wandb/) and mlflow (experiment "
        "MLFLOW_EXPERIMENT_NAME or dockrl, in MLFLOW_TRACKING_URI or else RUN_PARENT/mlflow.db). Samples go "
        "to each as a table; a resumed run continues its W&B and MLflow runs.",
    )
    device: Device = setting("auto", "cpu, cuda or auto (cuda when available).", noun="device")
    precision: Precision = setting(
        "auto",
        "fp32, or bf16 (bf16 compute, fp32 master weights and reductions); auto: bf16 on cuda and on a cpu "
        "with native bf16 (AVX512-BF16 or AMX), else fp32.",
        noun="precision",
    )
    ray_address: str | None = setting(None, "Address of a Ray cluster to join; None starts a local one.")
    worker_timeout_s: float = setting(
        1800.0, "A worker call taking longer becomes an error naming the worker (a hang is never silent)."
    )
    progress: bool = setting(True, "Show a progress bar on the console.")
    threads_per_rank: int = setting(
        0,
        "Torch threads of each trainer rank (actor, critic, teacher). 0 (auto): on cpu each group's ranks "
        "split the machine's cores (os.cpu_count() // ranks), on cuda torch keeps its default; N >= 1: "
        "exactly N, also on cuda (the CPU-side thread count). A cpu run whose N x (actor + critic + teacher "
        "ranks) exceeds the cores is warned about, not refused. Change it on a shared machine (1). Fewer ranks "
        "with more threads paid at small batches on one host and not on another (docs/benchmarks.md, "
        '"Rollout ranks and threads at small batches": 2 ranks x 1 thread 1.10x faster than 1 x 2 at 16 rows '
        "of the 8.3M model on a quiet Intel AMX host, 1.10x slower on an AMD host); measure yours with "
        "`dockrl bench rollout --threads`.",
    )


@dataclass
class PlacementConfig:
    """Which Ray nodes run each worker group, by the custom resources the nodes offer (`ray start
    --resources='{"rollout_pool": 8}'`; an emulated cluster's node i offers `node<i>`). Each list gives one
    resource per rank, cycled (rank i takes entry i mod length); a rank takes 0.001 of it, so any number of
    ranks fit a node. Empty lists leave placement to Ray. The dock's warehouses are one per node already."""

    actor: list[str] = setting([], "Custom resource per actor rank (dp x tp ranks), e.g. [node1, node2].")
    rollout: list[str] = setting([], "Custom resource per rollout rank (rollout.placement=separate).")
    reward: list[str] = setting([], "Custom resource per RewardWorker.")
    reward_model: list[str] = setting([], "Custom resource per RewardModelWorker.")
    critic: list[str] = setting([], "Custom resource per critic rank (PPO).")
    teacher: list[str] = setting([], "Custom resource per teacher rank (distill.teacher_path).")
    env: list[str] = setting([], "Custom resource per environment worker (env.num_workers).")


@dataclass
class EnvConfig:
    """Multi-turn rollout with an environment (docs/multiturn.md): turns of the policy and observations of the
    environment (tool answers), token in and token out; only the policy's tokens are trained on."""

    name: str | None = setting(
        None,
        "None: single-turn. `tools` (the built-in tool environment: env.kwargs.tools lists calculator, python), "
        "`package.module:Class`, or a file `path/to/file.py:Class` (read when the config is loaded and shipped, "
        "like reward files).",
    )
    kwargs: dict = setting({}, "Keyword arguments of the environment's constructor.")
    max_turns: int = setting(
        4, "Policy turns per trajectory; a trajectory still calling tools then ends truncated."
    )
    max_tool_calls: int = setting(8, "Tool calls per trajectory; one more ends it truncated.")
    max_response_tokens: int | None = setting(
        None,
        "Token budget of a whole trajectory after the prompt (sampled and observation tokens); None: room for "
        "every turn at rollout.max_new_tokens and env.max_observation_tokens between each two.",
    )
    max_observation_tokens: int = setting(
        64, "The observation size the default env.max_response_tokens makes room for between two turns."
    )
    call_timeout_s: float = setting(
        10.0,
        "Seconds one environment call (a reset, a step with its tool calls) may run, counted from when it starts; "
        "past it the trajectory ends truncated.",
    )
    num_workers: int = setting(
        1, "Environment worker processes (the environment tier, shared by every rollout rank; placement.env)."
    )
    concurrency: int = setting(
        16, "Environment calls each environment worker runs at once (threads; `async def` calls: no limit)."
    )
    reward_weight: float = setting(
        1.0, "Weight of the environment's final reward in the total (added to reward.functions' scores)."
    )
    allow_unsandboxed: bool = setting(
        False,
        "Let the python tool run model-written code as a plain subprocess where bubblewrap is missing (unsafe: "
        "docs/multiturn.md, the sandbox).",
    )
    source_file: str | None = setting(None, "Filled in when the config is loaded: the environment's file.")
    code: str | None = setting(None, "Filled in when the config is loaded: that file's source (leave unset).")


@dataclass
class TrainConfig:
    """`dockrl train`: a GRPO job."""

    model: ModelConfig
    data: DataConfig
    run: RunConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    dock: DockConfig = field(default_factory=DockConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # used only with algo.name=ppo
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn rollout when env.name is set
    distill: DistillConfig = field(
        default_factory=DistillConfig
    )  # a teacher when distill.teacher_path is set


@dataclass
class SFTRunConfig:
    """The SFT run."""

    epochs: float = setting(1.0, "Passes over the training file (fractions allowed).")
    batch_size: int = setting(32, "Examples per optimizer step.")
    seed: int = setting(0, "Seed for data order.")
    output_dir: str = setting("runs", "Parent directory of run directories.")
    name: str | None = setting(None, "Run directory name; None uses a timestamp.")
    max_len: int = setting(512, "Examples longer than this many tokens (prompt + answer) are skipped.")
    device: Device = setting("auto", "cpu, cuda or auto.", noun="device")
    precision: Precision = setting("auto", "fp32, bf16 or auto (as for train).", noun="precision")
    progress: bool = setting(True, "Show a progress bar on the console.")
    loggers: list[str] = setting(
        ["jsonl"],
        "Where each step's metrics go: jsonl (always on), tensorboard, wandb, mlflow (as for train).",
    )


@dataclass
class SFTConfig:
    """`dockrl sft`: supervised fine-tuning on prompt/answer pairs, loss on answer tokens only."""

    model: ModelConfig
    data: DataConfig
    run: SFTRunConfig = field(default_factory=SFTRunConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-3, micro_batch_size=32))
