"""Token budgets of a multi-turn trajectory, computed once from env.* and rollout.max_new_tokens.

trajectory budget   what a trajectory may hold after its prompt, sampled and observation tokens: env.max_response_tokens,
                    or by default room for every allowed turn at rollout.max_new_tokens and an observation of up to
                    env.max_observation_tokens between each two
policy budget       the most tokens the policy can sample in it: max_turns x max_new_tokens, within the trajectory
                    budget; what DAPO's overlong shaping and Dr. GRPO's constant normaliser count against
"""

from __future__ import annotations

from dockrl.config.schema import EnvConfig


def trajectory_budget(env: EnvConfig, max_new_tokens: int) -> int:
    """Tokens a trajectory may hold after its prompt (module docstring)."""
    if env.max_response_tokens is not None:
        return env.max_response_tokens
    return env.max_turns * max_new_tokens + (env.max_turns - 1) * env.max_observation_tokens


def policy_budget(env: EnvConfig, max_new_tokens: int) -> int:
    """Tokens the policy can sample in one trajectory (module docstring)."""
    return min(trajectory_budget(env, max_new_tokens), env.max_turns * max_new_tokens)
