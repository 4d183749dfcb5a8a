"""The batch search over a peak function (docs/design.md §4): pure, so it is tested without a model.

`largest` finds the largest batch for which a monotone test holds (on terms fitted from two small
batches, where a test costs only a solve). `settle` finds the largest batch whose smallest peak fits
the budget on terms probed at that batch, where each value of the peak function costs recorded steps:
it moves by secant steps from a guess and stops once the next batch is shown not to fit.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_BATCH = 1 << 16
# Secant steps `settle` takes before it only walks up one batch at a time.
SETTLE_STEPS = 16


def largest(fits: Callable[[int], bool], start: int) -> int:
    """The largest batch from `start` up to MAX_BATCH for which `fits` holds, by doubling then bisection
    (`fits` taken as monotone); 0 when it does not hold at `start`."""
    if not fits(start):
        return 0
    lo, hi = start, 2 * start
    while hi <= MAX_BATCH and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def settle(peak: Callable[[int], int], may_fit: Callable[[int], bool], guess: int, budget: int, b1: int, b2: int) -> int:
    """The largest batch b with `peak(b) <= budget` and `peak(b + 1)` over it (or `may_fit(b + 1)`
    false); 0 when batch b1 does not fit.

    `peak(b)` is the smallest peak at b on terms probed there (each call may record steps; it is called
    at most once per batch); `may_fit(b)` is False when the fitted terms put b clearly over the budget,
    so that b need not be probed. Starts from `guess` and moves by secant steps through the two probed
    batches nearest the last one (the smallest peak is close to linear in the batch), keeping a
    bracket [lo fits, hi does not].
    """
    seen: dict[int, int] = {}

    def at(b: int) -> int:
        if b not in seen:
            seen[b] = peak(b)
        return seen[b]

    lo, hi = (b2, None) if at(b2) <= budget else (b1, b2)
    if at(lo) > budget:
        return 0
    b = min(max(guess, lo + 1), hi - 1) if hi is not None else max(guess, lo + 1)
    for _ in range(SETTLE_STEPS):
        if hi is not None and hi - lo <= 1:
            break
        if at(b) <= budget:
            lo = b
        else:
            hi = b
        if hi is not None and hi - lo <= 1:
            break
        p, q = sorted(seen, key=lambda x: abs(x - b))[:2] if len(seen) >= 2 else (lo, b)
        slope = (seen[q] - seen[p]) / (q - p) if q != p else 0
        nxt = p + int((budget - seen[p]) // slope) if slope > 0 else lo + 1
        upper = hi - 1 if hi is not None else MAX_BATCH
        if hi is None and nxt <= lo and not may_fit(lo + 1):
            break  # the fitted line puts lo + 1 clearly over budget: no probe needed
        b = min(max(nxt, lo + 1), upper)
        if b in seen:  # no progress by secant: bisect the bracket
            b = (lo + upper + 1) // 2 if hi is not None else lo + 1
            if b in seen:
                break
    while (hi is None or hi > lo + 1) and may_fit(lo + 1) and at(lo + 1) <= budget:
        lo += 1
    return lo
