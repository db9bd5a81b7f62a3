"""KV kept across a trajectory's turns (Request.kv_key): a returning turn prefills only its new tokens on the kept
KV, with the same tokens as re-prefilling its whole prompt, in both cache layouts, when kept KV is given up for
room (eviction), and when a prompt does not extend what was kept (an agent that rewrote its history).

Log-probs: the kept keys and values of a turn's sampled tokens come from decode steps (one position at a time,
grouped batched matmuls), a re-prefill computes them in one causal pass (SDPA): the same sums in another order.
An fp32 sum of n terms is off by at most about n u of the sum of the terms' magnitudes (u = 2^-24); the widest
sums here are attention over at most MAX_SEQ_LEN = 160 positions and the 64-wide MLP, of softmax-weighted values
and activations of order 1, so each layer's output moves by ~160 u relative, and the 2 layers plus the LM head
(32 terms) compound that to under 4 x 160 u = 3.8e-5 on logits and log-probs of order 1; the bound below is
4 x 160 u x max(1, |logp|).
"""

import pytest
import torch

from dockrl.engines.rollout import rollout_engine
from dockrl.engines.rollout.rollout_engine import BLOCK_SIZE, Request, RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models import Transformer
from helpers import tiny_decoder

MAX_SEQ_LEN = 160
TURNS, OBSERVATION = 3, 5


def observation_len(row: int, turn: int) -> int:
    """Tokens of the observation after `turn` of trajectory `row`: ragged, so the returning turns prefilled
    together have suffixes of different lengths (padded to the longest in one forward)."""
    return OBSERVATION + (row + turn) % 4


def logprob_bound(logprobs: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    return 4 * MAX_SEQ_LEN * 2.0**-24 * logprobs.abs().clamp(min=1.0)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_decoder(MAX_SEQ_LEN)


def trajectories(engine, num: int, temperature: float, keep: bool, rewrite: int | None = None):
    """`num` trajectories of TURNS turns; after each turn but the last an observation of OBSERVATION tokens
    comes back 1 + row % 3 engine steps later (a tool running while the others decode), and the next turn's
    prompt is the whole trajectory so far (observations of observation_len tokens). Trajectory `rewrite` starts
    its second turn from another prompt (no longer an extension of its first). Returns each trajectory's turns'
    (token_ids, logprobs), and the number of engine steps that admitted a returning turn (`return_steps`)."""
    params = SamplingParams(max_new_tokens=12, temperature=temperature, stop_token_ids=[5])
    so_far = {row: [(7 * row + j) % 96 for j in range(3 + row % 5)] for row in range(num)}
    done: dict[int, list] = {row: [] for row in range(num)}
    returning: list[tuple[int, int]] = []  # (steps left, row)
    return_steps, returned = 0, False  # steps that admitted a later turn; one was submitted since the last

    def submit(row: int) -> None:
        turn = len(done[row])
        key = row if keep else None
        engine.add(Request(list(so_far[row]), [100 * row + turn], params, tag=row, kv_key=key))

    for row in range(num):
        submit(row)
    while engine.has_work() or returning:
        return_steps += int(returned and engine.has_work())
        returned = False
        for completion in engine.step() if engine.has_work() else []:
            row, generation = completion.tag, completion.generation
            done[row].append((generation.token_ids, generation.logprobs))
            so_far[row] += generation.token_ids.tolist()
            if len(done[row]) < TURNS:
                turn = len(done[row])
                so_far[row] += [(11 * row + 3 * turn + j) % 96 for j in range(observation_len(row, turn))]
                if row == rewrite and len(done[row]) == 1:
                    so_far[row] = [(5 * row + j) % 96 for j in range(9)]
                returning.append((1 + row % 3, row))
            else:
                engine.forget(row)
        returning = [(left - 1, row) for left, row in returning]
        for _, row in [r for r in returning if r[0] == 0]:
            submit(row)
            returned = True
        returning = [r for r in returning if r[0] > 0]
    assert not engine.kept
    return done, return_steps


def assert_same_tokens(kept, reference) -> None:
    assert kept.keys() == reference.keys()
    for row in kept:
        assert len(kept[row]) == len(reference[row]) == TURNS, row
        for (ids, logprobs), (ref_ids, ref_logprobs) in zip(kept[row], reference[row]):
            assert torch.equal(ids, ref_ids), row
            assert ((logprobs - ref_logprobs).abs() <= logprob_bound(ref_logprobs)).all(), row


def engine_of(
    model, layout: str, num_slots: int, kv_cache_tokens: int = 0, native: bool = True
) -> RolloutEngine:
    return RolloutEngine(
        model,
        num_slots=num_slots,
        max_seq_len=MAX_SEQ_LEN,
        kv_cache=layout,
        kv_cache_tokens=kv_cache_tokens,
        native_kernels=native,
    )


@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("native", [False, True])
def test_a_returning_turn_prefills_only_its_new_tokens_with_the_same_tokens(
    model, layout, temperature, native, monkeypatch
):
    """Room for everything: every later turn finds its KV (no eviction), prefills exactly what the re-prefill
    path prefilled minus what it found kept, and draws the same tokens. Without the native kernels the returning
    turns of a step run in a forward of their own (`_prefill_suffixes`); with them inside the step's decode
    forward (a mixed batch), and never in one of their own."""
    num = 6
    reference_engine = engine_of(model, layout, num_slots=8, native=native)
    reference, _ = trajectories(reference_engine, num, temperature, keep=False)
    engine = engine_of(model, layout, num_slots=8, native=native)
    own_forwards = []
    real = RolloutEngine._prefill_suffixes
    monkeypatch.setattr(
        RolloutEngine, "_prefill_suffixes", lambda self, r: own_forwards.append(len(r)) or real(self, r)
    )
    kept, return_steps = trajectories(engine, num, temperature, keep=True)
    assert len(own_forwards) == (0 if native else return_steps)
    assert_same_tokens(kept, reference)
    stats, before = engine.stats, reference_engine.stats
    assert stats["kv_evicted"] == 0 and reference_engine.stats["kv_reused_tokens"] == 0
    assert stats["kv_reused_tokens"] > 0
    assert stats["prefill_tokens"] + stats["kv_reused_tokens"] == before["prefill_tokens"]
    # Each later turn prefills its last sampled token and its observation.
    later = sum(observation_len(row, turn) + 1 for row in range(num) for turn in range(1, TURNS))
    first_prompts = sum(3 + row % 5 for row in range(num))
    assert stats["prefill_tokens"] == first_prompts + later
    # One forward for the first turns (all admitted at once), then one per step that admitted returning turns,
    # however many came back in it (fewer than the later turns: several return in the same step).
    assert return_steps < num * (TURNS - 1)
    assert stats["prefill_calls"] == 1 + return_steps


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_returning_turns_past_the_score_bound_run_in_several_forwards(model, layout, monkeypatch):
    """With room for the scores of one row only (SUFFIX_SCORES_MAX), each returning turn prefills in a forward of
    its own: one prefill call per later turn, the re-prefill path's tokens."""
    monkeypatch.setattr(rollout_engine, "SUFFIX_SCORES_MAX", 1)
    num = 6
    reference, _ = trajectories(engine_of(model, layout, num_slots=8), num, 1.0, keep=False)
    engine = engine_of(model, layout, num_slots=8)
    kept, return_steps = trajectories(engine, num, 1.0, keep=True)
    assert_same_tokens(kept, reference)
    assert return_steps < num * (TURNS - 1)
    assert engine.stats["prefill_calls"] == 1 + num * (TURNS - 1)


@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("native", [False, True])
def test_a_returning_turn_whose_padded_suffix_would_pass_the_cache_end_runs_alone(model, layout, native):
    """Two turns return in one step: A kept 140 positions and brings 3 new ones, B kept 8 and brings 21. Padded
    to B's 21, A's positions would run past max_seq_len = 160, so without the native kernels A runs in a
    forward of its own; with them nothing is padded and both run in the step's decode forward (a mixed batch).
    Both draw the re-prefill path's tokens either way."""
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    first = {0: [(3 * j) % 96 for j in range(137)], 1: [(5 * j + 1) % 96 for j in range(5)]}
    observation = {0: [7, 8], 1: [(j + 2) % 96 for j in range(20)]}
    results = {}
    for keep in (False, True):
        engine = engine_of(model, layout, num_slots=4, native=native)
        prompts, got = dict(first), {}
        for turn in range(2):
            for row, prompt in prompts.items():
                engine.add(Request(prompt, [10 * row + turn], params, tag=row, kv_key=row if keep else None))
            calls = engine.stats["prefill_calls"]
            for completion in engine.run():
                got.setdefault(completion.tag, []).append(completion.generation)
            if turn == 1 and keep:  # without the kernels B, then A alone; with them one mixed forward
                assert engine.stats["prefill_calls"] == calls + (1 if native else 2)
            prompts = {
                row: prompts[row] + got[row][0].token_ids.tolist() + observation[row] for row in prompts
            }
        assert engine.stats["kv_reused_tokens"] == (140 + 8 if keep else 0)
        results[keep] = got
    for row in (0, 1):
        for kept, reference in zip(results[True][row], results[False][row]):
            assert torch.equal(kept.token_ids, reference.token_ids)
            assert ((kept.logprobs - reference.logprobs).abs() <= logprob_bound(reference.logprobs)).all()


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_kept_kv_given_up_for_room_and_a_rewritten_prompt_keep_every_token(model, layout):
    """Fewer slots (slots) or blocks (paged) than the waiting trajectories' kept KV needs: the oldest kept KV is
    given up for new sequences, those turns re-prefill, and every token is the re-prefill path's. Trajectory 1's
    second prompt does not extend its first turn: its kept KV is dropped, not used."""
    num, temperature = 8, 1.0
    tight = dict(num_slots=5) if layout == "slots" else dict(num_slots=8, kv_cache_tokens=6 * BLOCK_SIZE)
    reference, _ = trajectories(engine_of(model, layout, **tight), num, temperature, keep=False, rewrite=1)
    engine = engine_of(model, layout, **tight)
    assert engine.layout == layout
    kept, _ = trajectories(engine, num, temperature, keep=True, rewrite=1)
    assert_same_tokens(kept, reference)
    assert engine.stats["kv_evicted"] > 0 and engine.stats["kv_reused_tokens"] > 0
    if layout == "paged":
        assert engine.cache.peak_used <= 6
