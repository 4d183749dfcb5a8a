"""Ground truth for tests: an independent measurement of one training iteration's peak on CPU.

It shares no code with ckpt_tune's runner: the profiler is started before the warm-up iteration, so
every allocation and free after the model was built (gradients, optimizer state, the batch, activations)
is seen, and the measured iteration's peak is the bytes allocated before profiling (parameters and
buffers) plus the largest running sum of allocator events inside that iteration (DESIGN.md §3).
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.utils.checkpoint as cp
from torch.profiler import ProfilerActivity, profile, record_function

MARK = "harness::measured"


def _wrap(model, names):
    """A plain non-reentrant checkpoint wrapper, independent of ckpt_tune.apply."""
    for name in names:
        if not isinstance(name, str):
            _wrap_segment(model, list(name))
            continue
        mod = model.get_submodule(name)
        inner = mod.forward

        def fwd(*args, _inner=inner, **kwargs):
            return cp.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        mod.forward = fwd


def _wrap_segment(model, names):
    """Consecutive blocks under one checkpoint, with the public API only and independent of
    ckpt_tune/segment.py: for chains `x = block(x, *rest, **kw)` whose blocks return one tensor and
    take the same `rest` and `kw`. The first block runs the whole segment inside one
    `torch.utils.checkpoint.checkpoint`; the blocks after it hand its result on unchanged."""
    mods = [model.get_submodule(n) for n in names]
    inners = [m.forward for m in mods]
    state = {}

    def run(x, *rest, **kw):
        for f in inners:
            x = f(x, *rest, **kw)
        return x

    def first(x, *rest, **kw):
        out = cp.checkpoint(run, x, *rest, use_reentrant=False, **kw)
        state["out"] = weakref.ref(out)  # a strong reference would keep it alive through backward
        return out

    def later(x, *rest, **kw):
        assert x is state["out"](), "segment blocks must be called as a chain"
        return x

    mods[0].forward = first
    for m in mods[1:]:
        m.forward = later


def measured_peak(
    build, make_batch, loss_fn, batch_size: int, checkpoint=(), optimizer: str = "adamw", accum_steps: int = 1
) -> int:
    """Peak live bytes of the second training iteration of a freshly built model (steady state).

    With `accum_steps` > 1 an iteration is that many micro-batches of `batch_size` (loss / steps,
    gradients summed by autograd) before the one optimizer step."""
    model = build()
    model.train()
    if checkpoint:
        _wrap(model, checkpoint)
    params = [p for p in model.parameters() if p.requires_grad]
    before = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
    gc.collect()  # earlier tests' garbage must not be freed (and reported) while profiling
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt = {
                "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
                "adam": lambda: torch.optim.Adam(params, lr=1e-3),
                "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
                "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
                "none": lambda: None,
            }[optimizer]()
            for i in range(2):
                if i == 1:
                    with record_function(MARK):
                        pass
                for p in params:
                    p.grad = None
                for _ in range(accum_steps):
                    loss = batch = None  # free the previous micro-batch's; the last one lives through the step
                    batch = make_batch(batch_size)
                    loss = loss_fn(model, batch)
                    if accum_steps > 1:
                        loss = loss / accum_steps
                    loss.backward()
                if opt is not None:
                    opt.step()
                del loss, batch
    finally:
        gc.enable()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() in ("[memory]", MARK)]
    events.sort(key=lambda e: e.start_ns())
    live, peak, started = 0, 0, False
    for e in events:
        if e.name() == MARK:
            started, peak = True, live
            continue
        if e.device_type() == torch.autograd.DeviceType.CPU:
            live += e.nbytes()
        if started:
            peak = max(peak, live)
    return sum(before.values()) + peak
