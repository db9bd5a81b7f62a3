"""Allocation policies of the dock: which ready rows a consumer gets, and how a stage's rows are balanced.

```
 ready & unconsumed rows --> units (rows, or whole groups) --policy--> preference order
                                                                          |
                              first-fit up to `count` rows <--------------+
 balance_over=k:  k*count rows --balanced_partition--> k bins of near-equal tokens (one per DP consumer)
```

A policy is a plain function `policy(candidates: Candidates) -> Sequence[int]` (or an int array) returning the
indices of the candidate units in order of preference (a subset is allowed: units left out are not served this
time). Name one in config as `dock.policy: "my_pkg.my_module:my_function"`; the built-ins are `first` (lowest
row ids), `oldest` (rows carried over from earlier steps first, then lowest row ids) and `local` (rows whose
payload lives on the caller's node first; its balanced bins are cut by node too, see locality.py). No Ray,
numpy only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dockrl.dock.errors import DockError


@dataclass
class Candidates:
    """The units a policy chooses from (one entry per unit: a row, or a whole group in whole_groups mode).

    first_rows: first row id of each unit. sizes: rows per unit. tokens: prompt+response tokens per unit
    (unknown response lengths count as 0). ages: steps the unit has survived a reset (0 = this step's).
    count: the most rows the consumer asked for. near: the share (0..1) of each unit's requested payload held
    by a warehouse on the caller's node (all 0 when the caller's node has none or is not known).
    """

    first_rows: np.ndarray
    sizes: np.ndarray
    tokens: np.ndarray
    ages: np.ndarray
    count: int
    near: np.ndarray


Policy = Callable[[Candidates], Sequence[int] | np.ndarray]  # unit indices, in order of preference


def first(candidates: Candidates) -> np.ndarray:
    """Lowest row ids first (the order rows were added)."""
    return np.arange(len(candidates.sizes))


def oldest(candidates: Candidates) -> np.ndarray:
    """Oldest first by age (rows carried over by partial rollout), then lowest row ids."""
    return np.argsort(-candidates.ages, kind="stable")


def local(candidates: Candidates) -> np.ndarray:
    """Units whose payload lives on the caller's node first (largest near share first), then lowest row ids:
    a consumer reads over its own node's link-free path when the table lets it. Which rows a rank gets then
    follows where they were produced, so a run repeats only up to the order of sums across ranks."""
    return np.argsort(-candidates.near, kind="stable")


BUILTIN_POLICIES: dict[str, Policy] = {"first": first, "oldest": oldest, "local": local}
LOCAL = "local"


def resolve_policy(name: str, setting: str = "dock.policy") -> Policy:
    """A built-in policy by name, or the function `module:function` (imported now, so typos fail early)."""
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise ValueError(
            f"{setting}={name!r} is neither a built-in policy {sorted(BUILTIN_POLICIES)} nor 'module:function'"
        )
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"{setting}={name!r} cannot be imported ({error}); make the module importable on every node "
            "(installed, or on PYTHONPATH) and check the function name"
        ) from error
    if not callable(function):
        raise ValueError(f"{setting}={name!r} is not callable")
    return function


def checked_order(policy: Policy, candidates: Candidates) -> np.ndarray:
    """Call `policy` and check it returned distinct valid unit indices (a broken policy must not lose rows)."""
    order = np.asarray(policy(candidates), dtype=np.int64).reshape(-1)
    num_units = len(candidates.sizes)
    if order.size and (order.min() < 0 or order.max() >= num_units or np.unique(order).size != order.size):
        name = getattr(policy, "__name__", repr(policy))
        raise DockError(
            f"dock policy {name} returned {order.tolist()[:16]}; it must return distinct indices into its "
            f"{num_units} candidates"
        )
    return order


def pack(order: np.ndarray, sizes: np.ndarray, count: int) -> np.ndarray:
    """Units taken first-fit in `order` while their rows fit in `count` (returns the taken unit indices)."""
    if np.all(sizes[order] == 1):
        return order[:count]
    taken, total = [], 0
    for unit in order:
        if total + sizes[unit] > count:
            continue
        taken.append(unit)
        total += sizes[unit]
        if total == count:
            break
    return np.asarray(taken, dtype=np.int64)


def balanced_partition(tokens: np.ndarray, num_bins: int) -> list[np.ndarray]:
    """Split items into `num_bins` bins whose sizes differ by at most one and whose token sums are near equal.

    Items are taken longest first in rounds of `num_bins`; in each round the longest item goes to the
    lightest bin, the next to the next lightest, and so on. Tolerance: the heaviest and lightest bin differ
    by at most the longest item (by at most max - min item when num_bins divides the item count), since
    each round can widen the spread only by its own first-minus-last item. Returns positions, ascending.
    """
    order = np.argsort(-tokens, kind="stable")
    loads = np.zeros(num_bins, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for start in range(0, len(order), num_bins):
        chunk = order[start : start + num_bins]
        lightest = np.argsort(loads, kind="stable")[: len(chunk)]
        for position, bin_index in zip(chunk, lightest):
            bins[bin_index].append(int(position))
            loads[bin_index] += tokens[position]
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in bins]
