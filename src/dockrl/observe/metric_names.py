"""The names of the figures an RL run logs per step (metrics.jsonl keys), declared once.

    recipes/step_metrics.py   writes them from a step's StepRecord
    recipes/grpo.py           adds the run loop's own (epoch, restarts, eval)
    observe/report.py, bench/ read them back from metrics.jsonl

Names are `section/name`. A worker's update metrics arrive as its own keys (actor keys without a section are
logged as actor/<key>); the actor keys the report draws are named here too.
"""

from __future__ import annotations

from dockrl.dock.stages import Stage

MEAN, STD, MIN, MAX = "mean", "std", "min", "max"  # the summaries of a per-row figure (describe)

# per-row rewards and answers
REWARD = "reward"  # reward/mean, reward/std, reward/min, reward/max
REWARD_MEAN = f"{REWARD}/{MEAN}"
REWARD_STD = f"{REWARD}/{STD}"
REWARD_RM = "reward/rm"  # mean raw reward-model score
REWARD_OVERLONG_PENALTY = "reward/overlong_penalty"  # DAPO overlong shaping: mean penalty (<= 0)
REWARD_OVERLONG_FRAC = "reward/overlong_frac"  # share of rows penalised
REWARD_TIMEOUTS = "reward/timeouts"
REWARD_ERRORS = "reward/errors"
REWARD_DROPPED_GROUPS = "reward/dropped_groups"  # reward.on_error=drop_group
TRAIN_ACCURACY = "train/accuracy"

# per-row response lengths (tokens)
RESPONSE_LENGTH = "response_length"  # response_length/mean, /std, /min, /max
RESPONSE_LENGTH_MEAN = f"{RESPONSE_LENGTH}/{MEAN}"
RESPONSE_LENGTH_MAX = f"{RESPONSE_LENGTH}/{MAX}"
RESPONSE_TRUNCATED_FRAC = f"{RESPONSE_LENGTH}/truncated_frac"  # cut at rollout.max_new_tokens

# the actor's update (all-reduced across its ranks)
ACTOR_PREFIX = "actor/"
ACTOR_KL = "actor/kl"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_CLIP_FRAC = "actor/clip_frac"
ACTOR_CLIP_FRAC_HIGH = "actor/clip_frac_high"
ACTOR_GRAD_NORM = "actor/grad_norm"

# wall time of the stages a step schedule times (observe.run_dir.StageTimer names), logged as timing/<stage>
TIMING_PREFIX = "timing/"
# The stages are dockrl.dock.stages.Stage, one vocabulary with the dock's consumers and the supervisor's stages.
# Timed: step (the whole step), weight_sync (separate placement: weights sent to the replicas), rollout (from
# the start of generation to its end, the switch included), reward_model and reward (from the start of
# generation to the last score), start_next (async: starting step t+k's generation), reference (the sync
# schedule starts it when generation ends, beside the last groups' scoring: then its slowest rank's own
# seconds), old_logprobs, critic_values (what is left of it after the log-prob stages), update.


def timing(stage: str) -> str:
    """The metric name of a timed stage: timing/<stage>."""
    return f"{TIMING_PREFIX}{stage}"


TIMING_STEP = timing(Stage.STEP)
TIMING_WEIGHT_SYNC = timing(Stage.WEIGHT_SYNC)
TIMING_ROLLOUT = timing(Stage.ROLLOUT)
TIMING_REWARD = timing(Stage.REWARD)
TIMING_REFERENCE = timing(Stage.REFERENCE)
TIMING_OLD_LOGPROBS = timing(Stage.OLD_LOGPROBS)
TIMING_CRITIC_VALUES = timing(Stage.CRITIC_VALUES)
TIMING_UPDATE = timing(Stage.UPDATE)
TIMING_RESHARD_TO_ROLLOUT = timing("reshard_to_rollout")  # the slowest rank's switch, inside timing/rollout
TIMING_ROLLOUT_BUSY = timing("rollout_busy")  # separate replicas: their own generating time

# tokens per second of wall time
THROUGHPUT_TOKENS_PER_S = "throughput/tokens_per_s"  # prompt + response tokens over the step
THROUGHPUT_ROLLOUT_TOKENS_PER_S = "throughput/rollout_tokens_per_s"  # response tokens over the rollout
THROUGHPUT_UPDATE_TOKENS_PER_S = "throughput/update_tokens_per_s"
THROUGHPUT_REFERENCE_TOKENS_PER_S = "throughput/reference_tokens_per_s"
TOKENS_PROMPT = "tokens/prompt"  # prompt tokens of the step's rows (a prompt counts once per sample)
TOKENS_RESPONSE = "tokens/response"

# the transfer dock over the step
DOCK_BYTES_IN_WAREHOUSES = "dock/bytes_in_warehouses"
DOCK_BYTES_MOVED = "dock/bytes_moved"  # put + got at the warehouses
DOCK_DRIVER_BYTES = "dock/driver_bytes"  # payload through the driver
DOCK_ROWS = "dock/rows"  # rows scored (and trained on)


def dock_p99(op: str) -> str:
    """The metric name of a controller op's p99 service time: dock/<op>_p99_ms."""
    return f"dock/{op}_p99_ms"


# asynchronous and partial rollout
STALENESS_MEAN = "async/staleness_mean"  # updates the trained policy is ahead of a row's oldest token
STALENESS_MAX = "async/staleness_max"
ROLLOUT_INTERRUPTED = "rollout/interrupted"  # partial: rows cut this step
ROLLOUT_CONTINUED = "rollout/continued"  # partial: carried rows continued this step

# DAPO dynamic sampling
# Multi-turn (env.name): per trajectory means, and shares of the step's trajectories.
ENV_TURNS = "env/turns"  # policy turns per trajectory
ENV_TOOL_CALLS = "env/tool_calls"  # tool calls per trajectory
ENV_TOOL_CALL_RATE = "env/tool_call_rate"  # share of trajectories with at least one tool call
ENV_TOOL_ERRORS = "env/tool_errors"  # malformed calls, unknown tools and tool errors (total)
ENV_TIMEOUTS = "env/timeouts"  # calls past env.call_timeout_s (total)
ENV_TRUNCATED = "env/truncated"  # share of trajectories that ran out of turns, calls or tokens
ENV_FAILED = "env/failed"  # trajectories whose environment raised (total)
ENV_TEMPLATE_MISMATCH = "env/template_mismatch"  # turns where the chat template was not append-only
# agent functions (docs/agents.md): requests whose prompt did not extend the sample's trajectory (the agent
# rewrote its history), each starting the trajectory over (total; 0 for environments)
AGENT_PREFIX_BREAKS = "agent/prefix_breaks"
ENV_POLICY_TOKEN_FRAC = (
    "env/policy_token_frac"  # share of response tokens the policy sampled (the rest observed)
)
THROUGHPUT_POLICY_TOKENS_PER_S = "throughput/policy_tokens_per_s"  # sampled tokens over the rollout
# positions the rollout prefilled (prompts, and the new tokens of later turns), summed over ranks
ROLLOUT_PREFILL_TOKENS = "rollout/prefill_tokens"
# positions later turns found kept from their earlier turns instead of prefilling them (keep_kv_across_turns)
ROLLOUT_KV_REUSED_TOKENS = "rollout/kv_reused_tokens"
TIMING_ENV = "timing/env"  # seconds inside environment calls, summed over calls (they overlap decoding)
TIMING_ENV_WAIT = (
    "timing/env_wait"  # wall seconds a rollout rank waited on calls with nothing to decode (max)
)

# rollout.backend=vllm: the weight update into the engines before the rollout (worst rank).
TIMING_WEIGHT_LOAD = "timing/weight_load"  # seconds to gather and load the weights into vLLM, probe included
ROLLOUT_WEIGHT_LOAD_MB = "rollout/weight_load_mb"  # MiB streamed into one engine
ROLLOUT_PROBE_ABS_DIFF = "rollout/probe_abs_diff"  # mean |vLLM - trainer| log-prob on the probe sequence
ROLLOUT_DIGEST_TENSORS = (
    "rollout/digest_tensors"  # tensors the weight digest checked (fewest over ranks; 0: none)
)

# On-policy distillation (distill.teacher_path): per sampled token, over the step's rows.
DISTILL_REVERSE_KL = "distill/reverse_kl"  # mean (sampling - teacher) log-prob: the reverse KL estimate
DISTILL_TEACHER_LOGPROB = "distill/teacher_logprob"  # mean teacher log-prob of the sampled tokens
# distill.top_k > 0, from the actor's update: mean over response tokens of the forward KL over the teacher's top-k
# and the tail (the loss term distill.coef weighs), and of the teacher's tail mass (1 - its top-k's probability)
DISTILL_TOPK_KL = "distill/topk_kl"
DISTILL_TEACHER_TAIL_MASS = "distill/teacher_tail_mass"
TIMING_TEACHER = "timing/teacher"  # from the start of generation to the teacher's last put (overlaps rollout)
TIMING_TEACHER_BUSY = "timing/teacher_busy"  # the teacher's own forward time (its cost per step; max rank)

DAPO_ROUNDS = "dapo/rounds"
DAPO_GENERATED_GROUPS = "dapo/generated_groups"
DAPO_INFORMATIVE_GROUPS = "dapo/informative_groups"
DAPO_FILLED_GROUPS = "dapo/filled_groups"
DAPO_DROPPED_GROUPS = "dapo/dropped_groups"

# the run loop's own
TRAIN_EPOCH = "train/epoch"  # epochs of the prompt set drawn so far
RUN_RESTARTS = "run/restarts"
EVAL_ACCURACY = "eval/accuracy"
EVAL_REWARD_MEAN = "eval/reward_mean"
