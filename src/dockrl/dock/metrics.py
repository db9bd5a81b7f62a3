"""Dock bookkeeping shared by its actors and clients: op latency windows and payload byte counts (no Ray)."""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

import numpy as np

LATENCY_WINDOW = 2048  # latest op durations kept per op for p50/p99


def payload_nbytes(value: Any) -> int:
    """Bytes held by one cell: `nbytes` for torch tensors and numpy arrays, sys.getsizeof for other objects."""
    # Duck-typed so that the warehouse process imports torch only once a tensor arrives.
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else sys.getsizeof(value)


def batch_nbytes(batch: dict[str, list]) -> int:
    """Bytes of a put/get batch, each distinct object counted once (add_groups repeats a prompt per row)."""
    seen: set[int] = set()
    total = 0
    for values in batch.values():
        for value in values:
            if id(value) not in seen:
                seen.add(id(value))
                total += payload_nbytes(value)
    return total


class OpLatency:
    """Durations of the latest LATENCY_WINDOW calls per op name, and running totals; `summary()` gives p50/p99
    in ms over the window, and the calls and seconds since start (how busy the actor is)."""

    def __init__(self) -> None:
        self._seconds: dict[str, deque] = {}
        self._totals: dict[str, list] = {}  # op -> [calls, seconds]

    def record(self, op: str, seconds: float) -> None:
        """Add one duration of `op`."""
        self._seconds.setdefault(op, deque(maxlen=LATENCY_WINDOW)).append(seconds)
        total = self._totals.setdefault(op, [0, 0.0])
        total[0] += 1
        total[1] += seconds

    def summary(self) -> dict[str, dict[str, float]]:
        """op -> {"p50_ms", "p99_ms", "count"} over the window, plus "total_calls" and "total_s" since start."""
        out = {}
        for op, window in self._seconds.items():
            ms = np.asarray(window) * 1e3
            calls, seconds = self._totals[op]
            out[op] = {
                "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)),
                "count": len(ms),
                "total_calls": calls,
                "total_s": seconds,
            }
        return out


def busy_totals(latency_ms: dict[str, dict[str, float]]) -> tuple[int, float]:
    """(calls, seconds) an actor has served, summed over its ops, from an `OpLatency.summary()`."""
    return (
        int(sum(op.get("total_calls", 0) for op in latency_ms.values())),
        float(sum(op.get("total_s", 0.0) for op in latency_ms.values())),
    )


def driver_bytes(stats: dict) -> int:
    """Payload bytes that passed through the driver, from the driver client's `stats()`.

    driver mode: every byte put to or got from the store (it lives in the driver); other modes: what the
    driver's own client put and got (the prompts, when the driver only adds groups).
    """
    if stats.get("mode") == "driver":
        return int(sum(w["bytes_in"] + w["bytes_out"] for w in stats["warehouses"]))
    client = stats.get("client", {})
    return int(client.get("bytes_put", 0) + client.get("bytes_got", 0))


def bytes_moved(stats: dict) -> int:
    """Payload bytes written to and read from the warehouses (all modes)."""
    return int(sum(w.get("bytes_in", 0) + w.get("bytes_out", 0) for w in stats.get("warehouses", [])))


COUNTER_KEYS = ("bytes_put", "bytes_got", "bytes_got_near", "latency")


class ClientCounters:
    """Per-process traffic counters of a dock client: `bytes_put`, `bytes_got` and op `latency`.

    They start at 0 wherever the client lives: pickling drops them and unpickling starts fresh, so a
    client passed to a worker counts only that worker's traffic (the driver's = bytes through the driver).
    """

    def _reset_counters(self) -> None:
        self.bytes_put = 0  # since the last reset (one step)
        self.bytes_got = 0
        self.latency = OpLatency()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in COUNTER_KEYS}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_counters()

    def client_stats(self) -> dict:
        """This process's client counters: bytes_put, bytes_got, latency_ms (end-to-end put/get)."""
        return {
            "bytes_put": self.bytes_put,
            "bytes_got": self.bytes_got,
            "latency_ms": self.latency.summary(),
        }
