"""The pure rules of multi-turn settings (env.*): numbers in range and the combinations multi-turn does not
support, each refused by name before anything starts. Loading the environment itself (user code) is
preflight's (recipes/preflight.py)."""

from __future__ import annotations

from dockrl.config.checks import positive
from dockrl.config.fields import config_error
from dockrl.config.schema import TrainConfig
from dockrl.config.step_plan import traits_of


def check_env(cfg: TrainConfig) -> None:
    """env.* in range, and no setting multi-turn cannot honour."""
    env = cfg.env
    if env.name is None:
        return
    for key, value in [
        ("env.max_turns", env.max_turns),
        ("env.num_workers", env.num_workers),
        ("env.concurrency", env.concurrency),
        ("env.call_timeout_s", env.call_timeout_s),
    ]:
        positive(key, value)
    positive("env.max_tool_calls", env.max_tool_calls, allow_zero=True)
    positive("env.max_observation_tokens", env.max_observation_tokens)
    turns, per_turn = env.max_turns, cfg.rollout.max_new_tokens
    least = turns * per_turn + (turns - 1)  # every turn at its limit, one token of observation between
    if env.max_response_tokens is not None and env.max_response_tokens < least:
        raise config_error(
            "env.max_response_tokens",
            env.max_response_tokens,
            f"cannot hold env.max_turns={turns} turns of rollout.max_new_tokens={per_turn} tokens and the "
            f"observations between them (at least {least}; later turns would end truncated)",
            f"raise it to {least} plus the observations' size, or unset it (the default makes room for "
            f"observations of env.max_observation_tokens={env.max_observation_tokens})",
        )
    estimator = traits_of(cfg.algo)
    # Whitening and KL-in-reward shape a value per token over the whole response, observation tokens too.
    if estimator.whitened or estimator.kl_in_reward or estimator.needs_critic or cfg.algo.kl_in_reward:
        raise config_error(
            "algo.name",
            cfg.algo.name,
            "multi-turn (env.name) trains with group-baseline advantages (grpo, dapo, rloo, dr_grpo, gspo); "
            "a critic, whitened advantages and KL in the reward are not masked to the policy's tokens yet",
            "use algo.name=grpo (or dapo, rloo, dr_grpo, gspo), or unset env.name",
        )
    if cfg.rollout.partial:
        raise config_error(
            "rollout.partial",
            True,
            "partial rollout cuts responses at a token budget; a multi-turn trajectory is cut at its turns",
            "remove rollout.partial (env.max_response_tokens bounds a trajectory)",
        )
