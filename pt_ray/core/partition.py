"""AutoPipe's partitioner: the exact min-max contiguous split of blocks into pipeline stages.

Pure module. The paper's Algorithm 1 is a greedy rule with a variance slack; this is the optimum:

1. dynamic programming over (stages, blocks) finds the smallest possible bottleneck ``B*``, the
   largest stage load of the best split (``O(K n^2)``; n is at most a few hundred blocks);
2. a second pass, among the splits whose every stage stays within ``B*``, picks the one with the
   smallest sum of squared loads, so the stages that are not the bottleneck are balanced too
   (and the answer is deterministic).

Stage 0 carries a fixed extra load (the embedding and the frozen prefix's forward), the last stage
another (the head and the loss); cuts fall on block boundaries only, so no residual connection
crosses a stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Partition", "partition"]

_REL_TOL = 1e-9


@dataclass(frozen=True)
class Partition:
    """A contiguous split of ``n`` blocks into ``K`` stages.

    Attributes:
        boundaries: ``K + 1`` offsets; stage ``k`` holds blocks ``[boundaries[k], boundaries[k+1])``
            (offsets into the weight list given to :func:`partition`).
        loads: per-stage load, extras included.
    """

    boundaries: tuple[int, ...]
    loads: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        """The largest stage load: what bounds the pipeline's throughput."""
        return max(self.loads)

    @property
    def num_stages(self) -> int:
        return len(self.loads)


def partition(
    weights: Sequence[float],
    num_stages: int,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> Partition:
    """Split ``weights`` into ``num_stages`` contiguous non-empty stages minimising the largest
    load.

    Args:
        weights: per-block load (seconds, or any additive unit), in block order; all >= 0.
        num_stages: K, with ``1 <= K <= len(weights)`` (K = 1 is allowed with no blocks).
        first_extra: load stage 0 carries besides its blocks (embedding, frozen prefix).
        last_extra: load the last stage carries besides its blocks (head, loss).

    Returns:
        The optimal :class:`Partition`; ties broken by the smallest sum of squared loads.

    Raises:
        ValueError: K out of range or a negative weight.
    """
    n = len(weights)
    if any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"block weights must be finite and >= 0, got {list(weights)}")
    if num_stages < 1 or (n > 0 and num_stages > n) or (n == 0 and num_stages != 1):
        raise ValueError(
            f"cannot split {n} blocks into {num_stages} non-empty stages; "
            f"choose between 1 and {max(n, 1)}"
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def load(stage: int, i: int, j: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (
            last_extra if stage == num_stages - 1 else 0.0
        )
        return prefix[j] - prefix[i] + extra

    if n == 0:
        return Partition((0, 0), (first_extra + last_extra,))

    bottleneck = _min_bottleneck(n, num_stages, load)
    limit = bottleneck * (1 + _REL_TOL) + _REL_TOL
    return _balanced_within(n, num_stages, load, limit)


def _min_bottleneck(n: int, k: int, load) -> float:
    # best[j][i]: the smallest bottleneck splitting blocks [0, i) into stages 0..j-1.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        # stage j-1 holds blocks [i, e); the stages after it need at least k - j blocks.
        for e in range(j, n - (k - j) + 1):
            b = inf
            for i in range(j - 1, e):
                cand = max(best[j - 1][i], load(j - 1, i, e))
                if cand < b:
                    b = cand
            best[j][e] = b
    return best[k][n]


def _balanced_within(n: int, k: int, load, limit: float) -> Partition:
    # cost[j][e]: the smallest sum of squared loads over splits of [0, e) into j stages whose
    # loads all stay within `limit`; arg[j][e] remembers where the last stage starts.
    inf = math.inf
    cost = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[-1] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0.0
    for j in range(1, k + 1):
        for e in range(j, n - (k - j) + 1):
            for i in range(j - 1, e):
                if cost[j - 1][i] == inf:
                    continue
                w = load(j - 1, i, e)
                if w > limit:
                    continue
                c = cost[j - 1][i] + w * w
                if c < cost[j][e]:
                    cost[j][e], arg[j][e] = c, i
    bounds = [n]
    e = n
    for j in range(k, 0, -1):
        e = arg[j][e]
        bounds.append(e)
    bounds.reverse()
    loads = tuple(load(s, bounds[s], bounds[s + 1]) for s in range(k))
    return Partition(tuple(bounds), loads)
