"""The alpha-beta cost of an all-reduce, by algorithm: a message costs
alpha + bytes / beta on a link (alpha the latency, beta the bandwidth). For n bytes
over p ranks (the formulas of TECHNIQUES.md section 7; tokenmill/dist/collectives.py
implements the three):

    ring   2 (p - 1) alpha + 2 (p - 1) / p  n / beta        bandwidth-optimal
    tree   2 log2(p) alpha + 2 n / beta                     pipelined (double) binary tree
    rhd    2 log2(p) alpha + 2 (p - 1) / p  n / beta         (+ 2 alpha + n / beta to fold
                                                             a non-power of two)

Rings suit few ranks and large messages, trees many ranks and small messages; the
crossover n* = alpha beta p (p - 1 - log2 p) (ring = tree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALGORITHMS = ("ring", "tree", "rhd")


@dataclass(frozen=True)
class Link:
    """A class of link between ranks: bandwidth in bytes/s per direction, latency in s."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got "
                             f"{self.bandwidth}, {self.latency}")

    def send_time(self, num_bytes: float) -> float:
        return self.latency + num_bytes / self.bandwidth


def all_reduce_time(algorithm: str, num_bytes: float, ranks: int, link: Link) -> float:
    """Seconds for an all-reduce of num_bytes over `ranks` ranks joined by `link`."""
    if ranks <= 1:
        return 0.0
    alpha, beta, p = link.latency, link.bandwidth, ranks
    log_p = math.ceil(math.log2(p))
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * num_bytes / beta
    if algorithm == "tree":
        return 2 * log_p * alpha + 2 * num_bytes / beta
    if algorithm == "rhd":
        fold = 0.0 if p & (p - 1) == 0 else 2 * alpha + num_bytes / beta
        return 2 * math.floor(math.log2(p)) * alpha + 2 * (p - 1) / p * num_bytes / beta + fold
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def best_algorithm(num_bytes: float, ranks: int, link: Link) -> tuple[str, float]:
    """The cheapest algorithm for this message and its time (ties: the earlier listed)."""
    times = {a: all_reduce_time(a, num_bytes, ranks, link) for a in ALGORITHMS}
    best = min(ALGORITHMS, key=lambda a: times[a])
    return best, times[best]


def ring_tree_crossover(ranks: int, link: Link) -> float:
    """Bytes below which the tree beats the ring: alpha beta p (p - 1 - log2 p)."""
    p = ranks
    return max(0.0, link.latency * link.bandwidth * p * (p - 1 - math.log2(p)))
