"""User-style reward functions for tests/unit/test_rewards.py, resolved as 'reward_fixtures:<name>'."""

import os
import time

from dockrl.rewards import RewardResult


def length_reward(prompt, response, label, *, scale=1.0):
    """A plain float: scale * len(response)."""
    return scale * len(response)


def parity_reward(prompt, response, label):
    """A RewardResult with two components."""
    even = len(response) % 2 == 0
    return RewardResult(score=1.0 if even else 0.0, components={"even": float(even), "length": len(response)})


def sleepy_reward(prompt, response, label, *, seconds=30.0):
    """Hangs for `seconds` when the response is 'hang', else scores 1."""
    if response == "hang":
        time.sleep(seconds)
    return 1.0


def failing_reward(prompt, response, label):
    """Raises on the response 'boom', else scores 1."""
    if response == "boom":
        raise RuntimeError("verifier exploded")
    return 1.0


def dying_reward(prompt, response, label):
    """Kills its own process (like a segfaulting verifier) on the response 'die', else scores 1."""
    if response == "die":
        os._exit(3)
    return 1.0


NOT_CALLABLE = 42


def sparse_reward(prompt, response, label):
    """1 for about one response in eight (a stable hash), else 0: many groups have no reward spread."""
    import zlib

    return 1.0 if zlib.crc32(response.encode()) % 8 == 0 else 0.0


def fails_on_three(prompt, response, label):
    """Raises when the response holds a 3, else 1: one failed call in a group (reward.on_error tests)."""
    if "3" in response:
        raise RuntimeError("verifier crashed on a 3")
    return 1.0


def pid_reward(prompt, response, label):
    """The process id it ran in: says whether a call ran in the caller's process or the pool's."""
    return float(os.getpid())


def cheap_pid_reward(prompt, response, label):
    """pid_reward, declared cheap (may run inline)."""
    return float(os.getpid())


cheap_pid_reward.cheap = True


def cheap_but_hangs(prompt, response, label, *, seconds=60.0):
    """Declared cheap, but hangs for `seconds` on the response 'hang' (a wrong declaration)."""
    if response == "hang":
        time.sleep(seconds)
    return 1.0


cheap_but_hangs.cheap = True
