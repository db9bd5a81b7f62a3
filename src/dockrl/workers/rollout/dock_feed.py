"""Serve rollout rows from the transfer dock through a RolloutEngine, pulling and writing back incrementally.

```
 loop:
   while the engine has room for a whole group and the dock may still have rows:
       pull up to min(groups_per_pull, free slots / group) whole groups of prompt_ids
         (blocking only when the engine is idle; otherwise a single non-blocking poll)
       rows with the same prompt (one group) -> one Request: one prefill, n samples, one seed per row
   engine.step()  -> samples finished this step -> put response_ids / rollout_logprobs for their rows
 until the dock says every row was served and the engine is empty
```

Rows are written back the step they finish, so reward workers (which pull whole groups) start on early
groups while later ones still generate. The client is passed in (anything with DockClient's `get` and
`put`), so tests drive this loop with a fake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dockrl.dock.columns import POLICY_VERSION, PROMPT_IDS, RESPONSE_IDS, ROLLOUT_LOGPROBS
from dockrl.dock.errors import DockTimeoutError
from dockrl.workers.rollout.rollout_engine import Completion, Request, RolloutEngine
from dockrl.workers.rollout.sampling import SamplingParams

ROLLOUT = "rollout"  # the dock consumer name of the rollout stage


def row_seed(run_seed: int, step: int, row: int) -> int:
    """Per-row sampling seed: independent of which rank serves the row or what else is in its batch."""
    return (run_seed * 1_000_003 + step * 100_003 + row * 7919) % (2**63 - 1)


def step_engine(model: Any, cfg: Any, pad_token_id: int, detokenize: Callable) -> RolloutEngine:
    """The continuous-batching engine of a run's rollout (cfg: a TrainConfig): rollout.max_batch_size slots,
    a KV cache for data.max_prompt_len + rollout.max_new_tokens positions."""
    roll = cfg.rollout
    return RolloutEngine(
        model,
        num_slots=roll.max_batch_size,
        max_seq_len=min(model.args.max_position_embeddings, cfg.data.max_prompt_len + roll.max_new_tokens),
        pad_token_id=pad_token_id,
        detokenize=detokenize,
    )


def serve_step(
    engine: RolloutEngine, client: Any, cfg: Any, step: int, stop_token_ids: list[int], version: int
) -> dict:
    """Roll out every row of step `step` from the dock with the run's sampling settings (cfg: a TrainConfig)
    and its per-row seeds, with the weights after `version` updates (each token's `policy_version`); what
    colocated actor ranks and separate rollout replicas both run."""
    roll = cfg.rollout
    params = SamplingParams(
        max_new_tokens=roll.max_new_tokens,
        temperature=roll.temperature,
        top_p=roll.top_p,
        top_k=roll.top_k,
        min_p=roll.min_p,
        stop_token_ids=stop_token_ids,
        stop_strings=list(roll.stop_strings),
    )
    return serve_from_dock(
        engine,
        client,
        consumer=ROLLOUT,
        params=params,
        group_size=roll.samples_per_prompt,
        groups_per_pull=roll.groups_per_pull,
        row_seed=lambda row: row_seed(cfg.run.seed, step, row),
        version=version,
    )


def serve_from_dock(
    engine: RolloutEngine,
    client: Any,
    *,
    consumer: str,
    params: SamplingParams,
    group_size: int,
    groups_per_pull: int,
    row_seed: Callable[[int], int],
    version: int | None = None,
) -> dict[str, Any]:
    """Generate a response for every row `consumer` gets from the dock; returns lengths and counts.

    row_seed(row) gives each row's sampling seed, so a row's response does not depend on which rank or
    batch serves it. With `version`, each response token's policy_version is put beside it.
    """
    exhausted = False
    lengths: list[int] = []
    truncated = 0
    num_puts = 0
    while True:
        while not exhausted and engine.num_free_slots() >= group_size:
            num_groups = min(groups_per_pull, engine.num_free_slots() // group_size)
            status, got = _pull(client, consumer, num_groups * group_size, group_size, engine.has_work())
            if status == "done":
                exhausted = True
            if got is None:
                break
            for request in _requests(*got, params, group_size, row_seed):
                engine.add(request)
        if not engine.has_work():
            break
        completions = engine.step()
        if completions:
            _put(client, completions, version)
            num_puts += 1
            lengths += [len(c.generation.token_ids) for c in completions]
            truncated += sum(c.generation.finish_reason == "length" for c in completions)
    return {"response_lengths": lengths, "truncated": truncated, "puts": num_puts, **engine.stats}


def _pull(
    client: Any, consumer: str, count: int, group_size: int, busy: bool
) -> tuple[str, tuple[list[int], dict[str, list]] | None]:
    """("rows", got), ("done", None) once every row was served, or ("later", None) when a busy engine's
    poll found nothing ready yet (it keeps decoding and asks again next step)."""
    try:
        got = client.get(
            consumer,
            [PROMPT_IDS],
            count,
            whole_groups=True,
            min_count=group_size,
            timeout_s=0.0 if busy else None,
        )
    except DockTimeoutError:
        if busy:
            return "later", None
        raise
    return ("done", None) if got is None else ("rows", got)


def _requests(
    rows: list[int],
    batch: dict[str, list],
    params: SamplingParams,
    group_size: int,
    row_seed: Callable[[int], int],
) -> list[Request]:
    """Consecutive rows with the same prompt (at most group_size) become one Request tagged by its rows."""
    requests: list[Request] = []
    previous: list[int] | None = None
    for row, prompt_ids in zip(rows, batch[PROMPT_IDS]):
        prompt = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
        if requests and prompt == previous and len(requests[-1].seeds) < group_size:
            requests[-1].seeds.append(row_seed(row))
            requests[-1].tag.append(row)
        else:
            requests.append(Request(prompt, [row_seed(row)], params, tag=[row]))
        previous = prompt
    return requests


def _put(client: Any, completions: list[Completion], version: int | None) -> None:
    rows = [c.tag[c.sample] for c in completions]
    batch = {
        RESPONSE_IDS: [c.generation.token_ids for c in completions],
        ROLLOUT_LOGPROBS: [c.generation.logprobs for c in completions],
    }
    if version is not None:
        batch[POLICY_VERSION] = [[version] * len(c.generation.token_ids) for c in completions]
    client.put(rows, batch)
