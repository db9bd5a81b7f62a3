"""Typed configs, the run side: how a run executes. Generation (`RolloutConfig`), the switch between the
training and rollout layouts (`ReshardConfig`), the transfer dock (`DockConfig`), the run's steps, resources and
outputs (`RunConfig`), where each worker group runs (`PlacementConfig`) and multi-turn environments
(`EnvConfig`). Each field is documented once, here; `TrainConfig` (schema.py) holds these sections, and
dockrl.config.schema re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dockrl.backends.vllm import VllmConfig
from dockrl.config.fields import required, setting

# Closed choices: a value outside them is an error listing them (config.loader). The algorithm's (Algorithm,
# LossAgg, RatioLevel, LossNormalizer, KLEstimator, KLControl, RolloutIS) are declared in algos/registry.py;
# algo.adv_estimator accepts every registered estimator (config/presets.py).
DockMode = Literal["dock", "single", "driver"]
DockTransport = Literal["socket", "ray"]
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["auto", "fp32", "bf16"]


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
        "while it decodes; 1.25x decode at 8 rows per rank). With native_kernels on a CPU with AMX tiles, laid "
        "out for the tiles instead and run by dockrl's own kernel (no oneDNN call cost: 2-4x per projection at "
        "8 rows), a decode step's layers in one native call. false: the model's own modules.",
    )
    native_kernels: bool = setting(
        True,
        "dockrl engine on a CPU: a decode step's work between its matmuls (residual adds and RMSNorms, RoPE, the "
        "KV write, attention over each row's own slots, SwiGLU) runs as three C kernels per layer instead of ~50 "
        "torch calls, built on first use with the host's C compiler (models/native; without one, or with "
        "DOCKRL_NATIVE=off, torch's ops as before). The same values up to the order of fp32 sums (in bf16 a "
        "value may round one ulp the other way, so tokens drawn later can differ); with it the KV cache is in the "
        "weights' dtype (bf16: half of fp32's bytes). Decode 1.7x at 8 rows per rank, 2.5x with a long tail "
        "(dockrl bench rollout --native ab). false: torch's ops and an fp32 cache on a CPU.",
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
