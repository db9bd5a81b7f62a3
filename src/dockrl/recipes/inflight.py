"""The generations of an asynchronous run (rollout.max_staleness=k), and the ones in flight at a checkpoint.

    step t trains in dock t mod (k+1) ◀── Generation(t): rows generated with the weights after update t-1-k
    steps t+1..t+k generate in the other docks meanwhile (started, or finished and waiting)

At a save after step t, steps t+1..t+k were generated (or are generating) with weights older than the
checkpoint's. `save_inflight` waits for each (its rows are fixed by its step number and weights version, so
waiting changes nothing), reads every complete column of its dock and writes them, with the rollout and
scoring results the step's metrics need, to <checkpoint>/inflight.pt. `load_inflight` puts them back into the
fresh docks of a resumed run, which then trains on the very rows the uninterrupted run trained on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dockrl.dock.columns import LABEL, PROMPT_IDS
from dockrl.recipes.common import EncodedPrompt
from dockrl.workers.results import GenerateResult, ScoreResult

INFLIGHT = "inflight.pt"
DUMP_CONSUMER = "checkpoint"  # the dock consumer name of save_inflight's read (other stages never see it)
FORMAT = 1


@dataclass
class Generation:
    """One step's rollout and scoring in its dock: running (`pending`), or finished (`results`)."""

    step: int
    version: int  # the trainer updates behind the weights that generate it
    dock: int
    batch: list[EncodedPrompt]
    started: float
    weight_sync_s: float
    pending: tuple[Any, Any, Any] | None  # (generating, scoring, model_scoring or None): Pending calls
    results: tuple[list[GenerateResult], list[ScoreResult], float] | None = None

    def finish(self) -> tuple[list[GenerateResult], list[ScoreResult], float]:
        """(per-replica generate results, per-reward-worker score results, seconds from start to the last
        score), waiting for the rollout and scoring the first time."""
        if self.results is None:
            assert self.pending is not None
            generating, scoring, model_scoring = self.pending
            gen = generating.wait()
            if model_scoring is not None:  # the reward workers wait for rm_score, so this ends first
                model_scoring.wait()
            scored = scoring.wait()
            self.results, self.pending = (gen, scored, time.perf_counter() - self.started), None
        return self.results


def save_inflight(root: Path, generations: list[Generation], client: Any, timeout_s: float) -> int:
    """Wait for every generation, then write their docks' rows and results to root/inflight.pt; returns the
    number of rows written. `client` is the driver's DockChoice over the run's docks."""
    records = []
    for generation in sorted(generations, key=lambda g: g.step):
        gen, scored, rollout_s = generation.finish()
        client.select(generation.dock)
        stats = client.stats()
        num_rows = stats["num_rows"]
        complete = sorted(c for c, ready in stats["ready"].items() if ready == num_rows)
        got = client.get(DUMP_CONSUMER, complete, num_rows, timeout_s=timeout_s)
        rows, columns = got if got is not None else ([], {})
        records.append(
            {
                "step": generation.step,
                "version": generation.version,
                "dock": generation.dock,
                "weight_sync_s": generation.weight_sync_s,
                "rollout_s": rollout_s,
                "prompts": [
                    {"ids": p.ids, "text": p.text, "label": p.label, "index": p.index}
                    for p in generation.batch
                ],
                "rows": rows,
                "columns": columns,
                "generate": [dataclasses.asdict(g) for g in gen],
                "score": [dataclasses.asdict(s) for s in scored],
            }
        )
    torch.save({"format": FORMAT, "generations": records}, root / INFLIGHT)
    return sum(len(r["rows"]) for r in records)


def load_inflight(root: Path, client: Any, group_size: int) -> dict[int, Generation]:
    """The finished generations of checkpoint `root` (step -> Generation), their rows put back into their
    docks; {} when the checkpoint has none (a synchronous run's)."""
    path = root / INFLIGHT
    if not path.exists():
        return {}
    data = torch.load(path, weights_only=True)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: in-flight format {data.get('format')!r}, this dockrl reads {FORMAT}")
    loaded: dict[int, Generation] = {}
    for record in data["generations"]:
        batch = [EncodedPrompt(**p) for p in record["prompts"]]
        client.select(record["dock"])
        rows = client.add_groups([torch.tensor(p.ids) for p in batch], [p.label for p in batch], group_size)
        if rows != record["rows"]:
            raise ValueError(
                f"{path}: step {record['step']}'s rows came back as {len(rows)} rows numbered differently "
                f"from the {len(record['rows'])} saved (is the dock empty on resume?)"
            )
        rest = {c: v for c, v in record["columns"].items() if c not in (PROMPT_IDS, LABEL)}
        if rows and rest:
            client.put(rows, rest)
        results = (
            [GenerateResult(**g) for g in record["generate"]],
            [ScoreResult(**s) for s in record["score"]],
            record["rollout_s"],
        )
        loaded[record["step"]] = Generation(
            record["step"],
            record["version"],
            record["dock"],
            batch,
            time.perf_counter(),
            record["weight_sync_s"],
            None,
            results,
        )
    return loaded
