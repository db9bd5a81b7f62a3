"""Sampling settings and the vectorized per-row token sampler of the rollout engine.

Shape letters: B rows (sequence slots sampled in one call), V vocabulary.

Order of operations for one row: scaled = logits / temperature; keep the top-k of scaled; keep the top-p
nucleus of what is left (renormalized); keep tokens whose probability is >= min_p times the most likely
token's; draw one token by inverse CDF from the row's uniform. Temperature 0 is greedy (argmax).

Every row carries its own settings (rows of different requests share one call), and its own random stream:
the uniform of a sample's t-th token is a pure function of (seed, t) - a counter-based generator (the
splitmix64 finalizer over a Weyl sequence, computed with int64 tensor ops on the logits' device). Nothing
depends on the row's position in the batch, on the other rows, or on how many draws were made before, so
the same request with the same seed gives the same tokens in any batch (batch invariance), and no CPU
generator or host round trip is needed per row (the decode step stays capturable in a CUDA graph).

Log-probs: log_softmax(logits / temperature)[token] over the FULL vocabulary in fp32, before any filter -
exactly what the trainer recomputes (`dockrl.algos.logprobs.token_logprobs`), so the two agree. Greedy rows
use temperature 1 in that formula.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _int64(value: int) -> int:
    """A 64-bit constant as the signed int64 torch stores (wrapping arithmetic keeps its bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_WEYL_SEED = _int64(0x9E3779B97F4A7C15)
_WEYL_STEP = _int64(0xD1B54A32D192ED03)
_MIX_1 = _int64(0xBF58476D1CE4E5B9)
_MIX_2 = _int64(0x94D049BB133111EB)


@dataclass
class SamplingParams:
    """How to sample the completions of one request."""

    max_new_tokens: int
    """Most tokens generated per sample (a stop token, if produced, counts)."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of top tokens with probability mass >= top_p; 1.0 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    min_p: float = 0.0
    """Keep only tokens with probability >= min_p * the top token's probability; 0.0 = off."""
    stop_token_ids: list[int] = field(default_factory=list)
    """A sample ends right after producing one of these tokens (finish_reason "stop")."""
    stop_strings: list[str] = field(default_factory=list)
    """A sample ends with the token whose text completes one of these strings (finish_reason "stop"); the
    engine needs a `detokenize` function for them."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p} must be in (0, 1]; use 1.0 to turn it off")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k={self.top_k} must be >= 0; use 0 to turn it off")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"sampling min_p={self.min_p} must be in [0, 1); use 0.0 to turn it off")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"sampling stop_strings={self.stop_strings} must not contain an empty string")


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1), float64 [B], from int64 seeds [B] and token indices steps [B].

    splitmix64(seed * W1 + (step + 1) * W2) with wrapping int64 arithmetic; the top 53 bits make the float.
    """
    z = seeds * _WEYL_SEED + (steps + 1) * _WEYL_STEP
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() * (1.0 / (1 << 53))


@dataclass
class RowSettings:
    """Per-row sampling settings as tensors [B] on the logits' device, plus host flags for fast paths."""

    temperature: torch.Tensor
    """float32 [B]; 0 marks a greedy row."""
    top_k: torch.Tensor
    """int64 [B]; 0 = off."""
    top_p: torch.Tensor
    """float32 [B]; 1.0 = off."""
    min_p: torch.Tensor
    """float32 [B]; 0.0 = off."""
    any_sort: bool
    """Some row uses top-k or top-p (needs a sort over the vocabulary)."""
    any_min_p: bool
    """Some row uses min-p."""
    all_greedy: bool
    """Every row is greedy: skip the random draw."""
    unit_temperature: bool
    """Every row samples at temperature 1 or greedily: no division of the logits."""
    any_greedy: bool
    """Some row is greedy: take an argmax too."""

    @staticmethod
    def build(params: list[SamplingParams], device: torch.device | str) -> RowSettings:
        """Settings of rows whose requests use `params` (one entry per row)."""
        return RowSettings(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            any_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            all_greedy=all(p.temperature == 0 for p in params),
            unit_temperature=all(p.temperature in (0.0, 1.0) for p in params),
            any_greedy=any(p.temperature == 0 for p in params),
        )


def filter_logits(scaled: torch.Tensor, rows: RowSettings) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, then top-p nucleus, then min-p set; scaled [B, V].

    The nucleus is the smallest prefix of tokens sorted by probability (renormalized after top-k) whose mass
    reaches top_p: a token is kept when the mass strictly before it is below top_p, so the most likely token
    always survives.
    """
    vocab_size = scaled.shape[-1]
    if rows.any_sort:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
        rank = torch.arange(vocab_size, device=scaled.device)  # [V]
        top_k = torch.where(rows.top_k > 0, rows.top_k, vocab_size)  # [B]
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
        outside = (mass_before >= rows.top_p[:, None]) & (rows.top_p < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    if rows.any_min_p:
        probs = torch.softmax(scaled, dim=-1)  # [B, V]
        threshold = rows.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    return scaled


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i takes the first token whose cumulative probability exceeds uniforms[i] * total; probs [B, V], which
    need not sum to 1 (the total is their sum)."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    targets = uniforms.to(cdf.dtype) * cdf[:, -1]  # [B]
    tokens = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(-1)
    # Rounding can push the target to the total (index V, or a zero-probability tail the cdf is flat over):
    # fall back to the last token that has probability. A zero-probability token is never the first index
    # whose cdf exceeds a target below the total, so only such rows need the fallback (rare: no [B, V] pass).
    tokens = tokens.clamp(max=probs.shape[-1] - 1)
    off = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
    if bool(off.any()):
        last_kept = probs.shape[-1] - 1 - (probs[off].flip(-1) > 0).int().argmax(dim=-1)
        tokens = tokens.masked_scatter(off, last_kept)
    return tokens


def sample_rows(
    logits: torch.Tensor, rows: RowSettings, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [B, V]; returns (tokens int64 [B], logprobs float32 [B]).

    seeds int64 [B] and steps int64 [B] (index of the token being drawn within its sample) pick the uniform.
    Passes over [B, V] per call, which a real vocabulary makes a large share of a decode step: the fp32 copy,
    the division by the temperature (none when every row samples at temperature 1 or greedily), the max, one
    exp whose sum is the log-normaliser's and whose cumulative sum the inverse CDF reads (unnormalised: the
    target is the uniform times the total); top-k / top-p add a sort and a softmax and min-p a softmax, only
    when a row asks. The fallback for a target rounded past the total costs no [B, V] pass (`inverse_cdf_sample`).
    """
    logits = logits.float()
    greedy = rows.temperature == 0  # [B]
    if rows.unit_temperature:
        scaled = logits
    else:
        temperature = torch.where(greedy, 1.0, rows.temperature)
        scaled = logits / temperature[:, None]  # [B, V]
    if rows.all_greedy:
        log_norm = torch.logsumexp(scaled, dim=-1)  # [B]: the log-probs' normaliser, over the full vocabulary
        tokens = scaled.argmax(dim=-1)
    else:
        if rows.any_sort or rows.any_min_p:
            log_norm = torch.logsumexp(scaled, dim=-1)
            weights = torch.softmax(filter_logits(scaled, rows), dim=-1)  # [B, V]
        else:  # one exp pass serves both: exp(z - max) is the normaliser's sum and the unnormalised probs
            peak = scaled.amax(dim=-1, keepdim=True)  # [B, 1]
            weights = (scaled - peak).exp_()  # [B, V]
            log_norm = peak.squeeze(-1) + weights.sum(dim=-1).log()  # logsumexp's own formula
        tokens = inverse_cdf_sample(weights, counter_uniforms(seeds, steps))  # the cdf's total scales u
        if rows.any_greedy:
            tokens = torch.where(greedy, scaled.argmax(dim=-1), tokens)
    logprobs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - log_norm
    return tokens, logprobs
