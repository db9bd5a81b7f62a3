"""Where a row's payload lives, and bins of rows that stay on one node (the `local` policy's arithmetic).

```
 controller: location[column][row] = warehouse  ->  held[row, warehouse] = elements of the requested cells there
 a caller on node N sends near = [warehouses on N]  ->  near share of a unit = held[unit, near] / held[unit, :]
 balance_over=k: rows sorted by home warehouse, cut into k bins, swapped until token sums are near equal
```

A cell's weight is its element count from the column schema: per-token columns count the row's response
length, `prompt_ids` its prompt length, per-row columns one (unknown lengths count one). The home of a row is the
warehouse holding most of its weight. No Ray, numpy only.
"""

from __future__ import annotations

import numpy as np

from dockrl.dock.columns import PROMPT_LEN, RESPONSE_LEN, spec_of
from dockrl.dock.policies import balanced_partition

_LENGTH_OF_KIND = {"token": RESPONSE_LEN, "prompt token": PROMPT_LEN}


def held_by_warehouse(
    rows: np.ndarray,
    columns: list[str],
    location: dict[str, np.ndarray],
    lengths: dict[str, np.ndarray],
    num_warehouses: int,
) -> np.ndarray:
    """[len(rows), num_warehouses] float: the elements of each row's `columns` that each warehouse holds."""
    held = np.zeros((rows.size, num_warehouses), dtype=np.float64)
    for column in columns:
        if column not in location:
            continue
        where = location[column][rows]
        length_name = _LENGTH_OF_KIND.get(spec_of(column).per)
        weight = np.ones(rows.size, dtype=np.float64)
        if length_name in lengths:
            weight = np.maximum(lengths[length_name][rows], 1).astype(np.float64)
        placed = where >= 0
        np.add.at(held, (np.flatnonzero(placed), where[placed]), weight[placed])
    return held


def near_share(held: np.ndarray, near: list[int] | None) -> np.ndarray:
    """Per row of `held`, the share of its weight on the `near` warehouses (0 where near is unknown)."""
    if not near or held.size == 0:
        return np.zeros(held.shape[0], dtype=np.float64)
    total = held.sum(axis=1)
    return held[:, near].sum(axis=1) / np.maximum(total, 1e-12)


def local_partition(tokens: np.ndarray, homes: np.ndarray, num_bins: int) -> list[np.ndarray]:
    """Positions split into `num_bins` bins with balanced_partition's promise (sizes differ by at most one, the
    heaviest and lightest bin differ by at most the longest item) and as few warehouses per bin as that allows.

    Rows are sorted by home warehouse (longest first within one) and cut into bins of the balanced sizes, so
    bin i holds the rows of the i-th warehouse when the warehouses hold equal shares. Then, while the token
    sums spread wider than the longest row, the heaviest and the lightest bin swap the pair of rows that
    narrows them most; if swaps cannot reach the bound, balanced_partition's bins are returned instead.
    Returns positions, ascending, bins ordered by their home warehouse.
    """
    n = tokens.size
    if n == 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(num_bins)]
    order = np.lexsort((-tokens, homes))
    sizes = [n // num_bins + (1 if i < n % num_bins else 0) for i in range(num_bins)]
    bins = [list(chunk) for chunk in np.split(order, np.cumsum(sizes)[:-1])]
    bound = int(tokens.max())
    for _ in range(n * num_bins):  # each swap narrows the pair it touches: bounded well below this
        loads = np.array([int(tokens[b].sum()) if b else 0 for b in bins])
        heavy, light = int(np.argmax(loads)), int(np.argmin(loads))
        spread = loads[heavy] - loads[light]
        if spread <= bound:
            return [np.sort(np.asarray(b, dtype=np.int64)) for b in bins]
        gain = tokens[bins[heavy]][:, None] - tokens[bins[light]][None, :]  # [heavy rows, light rows]
        narrowed = np.where(gain > 0, np.abs(spread - 2 * gain), spread)
        a, b = np.unravel_index(int(np.argmin(narrowed)), narrowed.shape)
        if narrowed[a, b] >= spread:
            break
        bins[heavy][a], bins[light][b] = bins[light][b], bins[heavy][a]
    return balanced_partition(tokens, num_bins)
