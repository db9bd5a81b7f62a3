"""`dockrl bench logprobs`: memory and time of training's log-probs at a real vocabulary.

One forward and backward pass of log-probs and entropies (loss = sum(a * logp + b * entropy)) from hidden states
[N, H] and an LM head [V, H], at Qwen2.5-0.5B's head by default (V = 151,936, H = 896) and an 8k-token
micro-batch, two ways:
  fused   dockrl.algos.head_logprobs.head_token_stats: chunks of tokens, logits recomputed in backward
  naive   logits = h @ W.T in one piece, then log_softmax-style statistics (what a trainer without the fused
          path does: the [N, V] logits and their fp32 gradient exist at once)

Memory is counted exactly, not read from the allocator: `PeakMemory` follows every tensor storage allocated while
it is on (a torch dispatch mode) until it is freed, so the peak is that of this part alone: above its inputs
(hidden states, weight, targets) and, as reported, less the weight's gradient (which any trainer holds).
"""

from __future__ import annotations

import argparse
import weakref

from torch.utils._python_dispatch import TorchDispatchMode


class PeakMemory(TorchDispatchMode):
    """Bytes of tensor storage allocated inside the block and still alive: `now`, and its high-water `peak`.
    A storage is counted once, when an op makes it (views and in-place results share their input's); storages
    made before the block are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch
        from torch.utils._pytree import tree_flatten

        def storages(tree):
            for value in tree_flatten(tree)[0]:
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    yield value.untyped_storage()

        seen = {
            storage.data_ptr() for storage in storages((args, kwargs or {}))
        }  # views and in-place results
        out = func(*args, **(kwargs or {}))
        for storage in storages(out):
            key = storage.data_ptr()
            if key in seen or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key)
        return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Head and micro-batch shape."""
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the micro-batch (N)")
    parser.add_argument("--vocab-size", type=int, default=151936, help="V (Qwen2.5's by default)")
    parser.add_argument("--hidden-size", type=int, default=896, help="H (Qwen2.5-0.5B's by default)")
    parser.add_argument(
        "--paths", default="fused", help="comma-separated: fused, naive (naive holds [N, V] logits: GBs)"
    )


def run(args: argparse.Namespace) -> list[dict]:
    """One row per path: peak MiB above the inputs less the weight's gradient, and seconds of the pass."""
    return [measure(path, args.tokens, args.vocab_size, args.hidden_size) for path in args.paths.split(",")]


def measure(path: str, tokens: int, vocab: int, hidden: int, temperature: float = 0.7) -> dict:
    """Peak memory (MiB) and time of one forward and backward pass of `path` (fused or naive) in fp32."""
    import time

    import torch

    from dockrl.algos.head_logprobs import chunk_tokens, head_token_stats
    from dockrl.algos.logprobs import token_entropy, token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_(True)  # [N, H]
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_(True)  # [V, H]
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    a, b = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    start = time.perf_counter()
    with PeakMemory() as memory:
        if path == "fused":
            logp, entropy = head_token_stats(h, w, targets, temperature)
        elif path == "naive":
            logits = h @ w.T  # [N, V]
            logp, entropy = token_logprobs(logits, targets, temperature), token_entropy(logits, temperature)
            del logits
        else:
            raise ValueError(f"--paths: unknown path {path!r}; use fused or naive")
        ((logp * a).sum() + (entropy * b).sum()).backward()
    seconds = time.perf_counter() - start
    grad_bytes = w.grad.untyped_storage().nbytes()
    return {
        "path": path,
        "tokens": tokens,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "chunk_tokens": chunk_tokens(vocab) if path == "fused" else tokens,
        "peak_mb": (memory.peak - grad_bytes) / 2**20,
        "logits_fp32_mb": tokens * vocab * 4 / 2**20,  # one [N, V] fp32 tensor, for scale
        "seconds": seconds,
    }
