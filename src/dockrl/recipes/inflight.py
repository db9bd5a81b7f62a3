"""The generations of an asynchronous run (rollout.max_staleness=k), and the ones in flight at a checkpoint.

    step t trains in dock t mod (k+1) ◀── Generation(t): rows generated with the weights after update t-1-k
    steps t+1..t+k generate in the other docks meanwhile (started, or finished and waiting)

At a save after step t, steps t+1..t+k were generated (or are generating) with weights older than the
checkpoint's. `save_inflight` waits for each (its rows are fixed by its step number and weights version, so
waiting changes nothing), reads every complete column of its dock and writes them, with the rollout and
scoring results the step's metrics need, to <checkpoint>/inflight.pt. The read is a `peek`: it consumes
nothing, because with k >= 2 a step stays in flight across several saves and each must hold all its rows
(a step whose record would lack rows raises InflightSaveError, and the checkpoint is never committed). `load_inflight` puts them back into the
fresh docks of a resumed run, which then trains on the very rows the uninterrupted run trained on.

Partial rollout (rollout.partial) keeps the groups of cut responses in the dock from one step to the next; a
checkpoint holds them too ("carried": every row's age, the finished rows' responses and the cut rows' tokens so
far), and `load_inflight` rebuilds the table with the same row numbers and ages, so their continuation draws
the same tokens.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dockrl.algos.distill import DistillSums
from dockrl.dock.choice import DockChoice
from dockrl.dock.columns import (
    ENV_ROW,
    IMAGE_GRID_THW,
    IMAGE_PATCHES,
    IMAGE_REFS,
    LABEL,
    PARTIAL_IDS,
    PARTIAL_LOGPROBS,
    PARTIAL_VERSIONS,
    POLICY_VERSION,
    PROMPT_IDS,
    RESPONSE_IDS,
    ROLLOUT_LOGPROBS,
)
from dockrl.dock.stages import Stage
from dockrl.recipes.common import EncodedPrompt, add_prompts
from dockrl.workers.results import GenerateResult, ScoreResult, TeacherResult

INFLIGHT = "inflight.pt"
IMAGE_COLUMNS = (IMAGE_PATCHES, IMAGE_GRID_THW, IMAGE_REFS)  # put by add_prompts from the saved prompts
DUMP_CONSUMER = Stage.CHECKPOINT  # the stage of load_inflight's puts (a save peeks: it consumes nothing)
FORMAT = 1


class InflightSaveError(RuntimeError):
    """A step in flight could not be read whole from its dock: the checkpoint being written would not resume."""


@dataclass
class Generation:
    """One step's rollout and scoring in its dock: running (`pending`), or finished (`results`)."""

    step: int
    version: int  # the trainer updates behind the weights that generate it
    dock: int
    batch: list[EncodedPrompt]
    started: float
    weight_sync_s: float
    # (generating, scoring, model_scoring or None, teaching or None): Pending calls
    pending: tuple[Any, Any, Any, Any] | None
    results: tuple[list[GenerateResult], list[ScoreResult], float] | None = None
    teacher: list[TeacherResult] = field(
        default_factory=list
    )  # distillation: per teacher rank, once finished

    def finish(self) -> tuple[list[GenerateResult], list[ScoreResult], float]:
        """(per-replica generate results, per-reward-worker score results, seconds from start to the last
        score), waiting for the rollout and scoring the first time."""
        if self.results is None:
            assert self.pending is not None
            generating, scoring, model_scoring, teaching = self.pending
            gen = generating.wait()
            if model_scoring is not None:  # the reward workers wait for rm_score, so this ends first
                model_scoring.wait()
            if teaching is not None:  # and for teacher_logprobs
                self.teacher = teaching.wait()
            scored = scoring.wait()
            self.results, self.pending = (gen, scored, time.perf_counter() - self.started), None
        return self.results


def save_inflight(
    root: Path, generations: list[Generation], client: DockChoice, *, carried: bool = False
) -> int:
    """Wait for every generation, then write their docks' rows and results (and with `carried`, partial
    rollout's carried groups) to root/inflight.pt; returns the number of rows written. `client` is the
    driver's client (a DockChoice over the docks of an asynchronous run)."""
    records: list[dict[str, Any]] = []
    for generation in sorted(generations, key=lambda g: g.step):
        gen, scored, rollout_s = generation.finish()
        client.select(generation.dock)
        stats = client.stats()
        num_rows = stats["num_rows"]
        complete = sorted(c for c, ready in stats["ready"].items() if ready == num_rows)
        rows, columns = client.peek(complete) if complete else ([], {})
        if num_rows == 0 or stats["num_groups"] != len(generation.batch) or rows != list(range(num_rows)):
            raise InflightSaveError(
                f"step {generation.step}, in flight in dock {generation.dock}, holds {num_rows} rows in "
                f"{stats['num_groups']} groups for its {len(generation.batch)} prompts and {len(rows)} could be "
                f"read whole (columns {complete}): a checkpoint holding it could not resume, so none is written"
            )
        records.append(
            {
                "step": generation.step,
                "version": generation.version,
                "dock": generation.dock,
                "weight_sync_s": generation.weight_sync_s,
                "rollout_s": rollout_s,
                "prompts": [_prompt_record(p) for p in generation.batch],
                "rows": rows,
                # the driver's image columns go back from the prompts (add_prompts), stored once per prompt
                "columns": {c: v for c, v in columns.items() if c not in IMAGE_COLUMNS},
                "generate": [dataclasses.asdict(g) for g in gen],
                "score": [dataclasses.asdict(s) for s in scored],
                "teacher": [dataclasses.asdict(t) for t in generation.teacher],
            }
        )
    kept = _read_carried(client) if carried else None
    torch.save({"format": FORMAT, "generations": records, "carried": kept}, root / INFLIGHT)
    return sum(len(r["rows"]) for r in records) + (len(kept["ages"]) if kept else 0)


def _prompt_record(prompt: EncodedPrompt) -> dict[str, Any]:
    """A prompt as inflight.pt holds it (tensors and plain values: torch.load(weights_only=True) reads it)."""
    record = {
        "ids": prompt.ids,
        "text": prompt.text,
        "label": prompt.label,
        "index": prompt.index,
        "env_row": prompt.env_row,
    }
    if prompt.image_patches is not None:  # a vision-language model's row: its images, as the dock holds them
        record.update(
            image_patches=prompt.image_patches, image_grid_thw=prompt.image_grid_thw, images=prompt.images
        )
    return record


_FINISHED = [PROMPT_IDS, LABEL, RESPONSE_IDS, ROLLOUT_LOGPROBS, POLICY_VERSION]
_CUT = [PROMPT_IDS, LABEL, PARTIAL_IDS, PARTIAL_LOGPROBS, PARTIAL_VERSIONS]


def _read_carried(client: DockChoice) -> dict[str, Any] | None:
    """The carried groups of a partial-rollout dock between steps: ages, finished rows, cut rows."""
    ages = client.ages()
    if not ages:
        return None
    ready = client.stats()["ready"]
    images = [c for c in IMAGE_COLUMNS if ready.get(c, 0)]  # a vision-language model's rows
    parts: dict[str, dict[str, Any]] = {}
    for part, columns, marker in (("finished", _FINISHED, RESPONSE_IDS), ("cut", _CUT, PARTIAL_IDS)):
        rows, values = client.peek(columns + images) if ready.get(marker, 0) else ([], {})
        parts[part] = {"rows": rows, "columns": values if rows else {}}
    # A row continued and finished still holds its old partial columns: cut rows are those without a response.
    finished = set(parts["finished"]["rows"])
    keep = [i for i, row in enumerate(parts["cut"]["rows"]) if row not in finished]
    cut = parts["cut"]
    parts["cut"] = {
        "rows": [cut["rows"][i] for i in keep],
        "columns": {c: [v[i] for i in keep] for c, v in cut["columns"].items()},
    }
    return {"ages": ages, **parts}


def _restore_carried(kept: dict[str, Any], client: DockChoice, group_size: int) -> None:
    """Rebuild the carried groups with their row numbers and ages: groups are added oldest first, one age at a
    time, each followed by the reset that ages them (as the original steps did)."""
    from dockrl.engines.rollout.dock_feed import ROLLOUT

    ages, n = kept["ages"], group_size
    cells: dict[int, dict[str, Any]] = {}
    for part in ("finished", "cut"):
        for i, row in enumerate(kept[part]["rows"]):
            cells[row] = {c: v[i] for c, v in kept[part]["columns"].items()}
    group_age = [ages[g * n] for g in range(len(ages) // n)]
    for age in range(max(group_age), 0, -1):
        groups = [g for g, a in enumerate(group_age) if a == age]
        if groups:
            first = [cells[g * n] for g in groups]
            extra = {c: [cell[c] for cell in first] for c in IMAGE_COLUMNS if c in first[0]}
            prompts, labels = [torch.as_tensor(c[PROMPT_IDS]) for c in first], [c[LABEL] for c in first]
            if extra:
                rows = client.add_groups(prompts, labels, n, extra=extra)
            else:
                rows = client.add_groups(prompts, labels, n)
            for part_columns in (_FINISHED, _CUT):
                old = [g * n + i for g in groups for i in range(n) if part_columns[2] in cells[g * n + i]]
                new = [rows[groups.index(r // n) * n + r % n] for r in old]
                if old:
                    batch = {c: [cells[r][c] for r in old] for c in part_columns[2:]}
                    client.put(DUMP_CONSUMER, new, batch)
        client.reset(keep_unfinished=RESPONSE_IDS, served_by=ROLLOUT)
    if client.ages() != ages:
        raise ValueError(f"carried groups restored with ages {client.ages()}, saved {ages}")


def load_inflight(root: Path, client: DockChoice, group_size: int) -> dict[int, Generation]:
    """The finished generations of checkpoint `root` (step -> Generation), their rows put back into their
    docks; {} when the checkpoint has none (a synchronous run's)."""
    path = root / INFLIGHT
    if not path.exists():
        return {}
    data = torch.load(path, weights_only=True)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: in-flight format {data.get('format')!r}, this dockrl reads {FORMAT}")
    if data.get("carried"):
        _restore_carried(data["carried"], client, group_size)
    loaded: dict[int, Generation] = {}
    for record in data["generations"]:
        batch = [EncodedPrompt(**p) for p in record["prompts"]]
        client.select(record["dock"])
        rows = add_prompts(client, batch, group_size)
        if rows != record["rows"]:
            raise ValueError(
                f"{path}: step {record['step']}'s rows came back as {len(rows)} rows numbered differently "
                f"from the {len(record['rows'])} saved (is the dock empty on resume?)"
            )
        # prompt_ids too: an agent run's rollout replaced each row's prompt with its agent's first request
        rest = {c: v for c, v in record["columns"].items() if c not in (LABEL, ENV_ROW, *IMAGE_COLUMNS)}
        if rows and rest:
            client.put(DUMP_CONSUMER, rows, rest)
        results = (
            [GenerateResult(**g) for g in record["generate"]],
            [ScoreResult(**s) for s in record["score"]],
            record["rollout_s"],
        )
        teacher = [
            TeacherResult(t["rows"], DistillSums(**t["sums"]), t["busy_s"]) for t in record.get("teacher", [])
        ]
        loaded[record["step"]] = Generation(
            record["step"],
            record["version"],
            record["dock"],
            batch,
            time.perf_counter(),
            record["weight_sync_s"],
            None,
            results,
            teacher,
        )
    return loaded
