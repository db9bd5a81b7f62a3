"""What the memory benchmarks share: a training engine in its steady state, and this process's RSS peak.

`take_one_step` runs one optimizer step on two random rows per data-parallel rank, so parameters, gradients
and AdamW state all exist (the steady state a switch or a checkpoint starts from). `rss_reset` / `proc_status`
read Linux /proc: CPU peaks only mean something if freed tensors leave RSS, so the benchmarks pin glibc's mmap
threshold (MALLOC_MMAP_THRESHOLD_=65536) before spawning their ranks.
"""

from __future__ import annotations


def take_one_step(engine, dp: int, seed: int) -> None:
    """One policy-gradient optimizer step of `engine` on two random 8+8-token rows (seed: this dp rank's)."""
    import torch

    from dockrl.config import AlgoConfig
    from dockrl.config.step_plan import loss_plan
    from dockrl.dock.columns import ADVANTAGES, PROMPT_IDS, RESPONSE_IDS
    from dockrl.engines.train.policy_update import policy_update

    vocab = engine.args.vocab_size
    g = torch.Generator().manual_seed(seed)
    batch = {
        PROMPT_IDS: [torch.randint(0, vocab, (8,), generator=g) for _ in range(2)],
        RESPONSE_IDS: [torch.randint(0, vocab, (8,), generator=g) for _ in range(2)],
        ADVANTAGES: [torch.ones(8), -torch.ones(8)],
    }
    plan = loss_plan(AlgoConfig(kl_coef=0.0))
    policy_update(
        engine,
        batch,
        [0, 1],
        [ADVANTAGES],
        plan,
        temperature=1.0,
        micro_batch_size=2,
        pad_token_id=0,
        world_size=dp,
    )


def rss_reset() -> int:
    """Reset this process's RSS high-water mark (VmHWM); returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def proc_status(key: str) -> int:
    """A byte figure of /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")
