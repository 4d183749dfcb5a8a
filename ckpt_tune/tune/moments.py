"""What is live at the largest moment of each phase of a recorded step, split into the five parts.

Measured moments feed the per-GPU arithmetic of sharding.py (remedies, sharded search); the split is
exact: the five parts of each moment sum to the recorded live bytes at that instant.
"""

from __future__ import annotations

from dataclasses import replace

from ckpt_tune.measure.profiler import peak_phase
from ckpt_tune.measure.runner import Measurement
from ckpt_tune.tune.sharding import Moment


def moments_of(m: Measurement) -> tuple[Moment, ...]:
    """The largest moment of each phase of a recorded step, split into the five parts exactly.

    Saved activations and gradients are told apart by allocation: a saved tensor's allocation is the one
    live at the end of forward, a gradient's the one live at the end of backward (as profiler.live_at_peak).
    """
    tl, mk = m.timeline, m.timeline.markers
    t_iter, t_loss, t_bwd, t_step = (mk[k][0] for k in ("iter", "loss", "backward", "step"))
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for ptr, size, t0, t1 in tl.intervals():
        spans.setdefault(ptr, []).append((t0, t1, size))

    def live(ptr: int, anchor: int, t: int) -> int:
        return sum(size for t0, t1, size in spans.get(ptr, ()) if t0 <= anchor < t1 and t0 <= t < t1)

    grad_ptrs = set(m.grad_ptrs)
    static = m.param_bytes + m.optimizer_bytes
    out = [
        Moment(m.param_bytes, m.grad_bytes, m.optimizer_bytes, 0, 0,
               "start", "start of the iteration (previous gradients still live)", 0.0),
    ]
    for phase, a, b in (("forward", t_iter, t_loss), ("backward", t_loss, t_bwd), ("step", t_bwd, t_step + 1)):
        top, when = tl.max_between(a, b)
        by_owner: dict[str, int] = {}
        for ptr, (_nbytes, owner) in m.saved.items():
            n = live(ptr, t_loss, when)
            if n:
                key = owner if owner is not None else ""
                by_owner[key] = by_owner.get(key, 0) + n
        acts = sum(by_owner.values())
        grads = sum(live(p, t_bwd, when) for p in grad_ptrs)
        where = peak_phase(replace(m, peak_time=when))
        out.append(
            Moment(m.param_bytes, grads, m.optimizer_bytes, acts, m.static_bytes + top - static - grads - acts,
                   phase, where, (when - t_iter) / 1e6, tuple(sorted(by_owner.items(), key=lambda kv: -kv[1])))
        )
    return tuple(out)
