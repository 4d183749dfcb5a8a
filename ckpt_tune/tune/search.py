"""`search`: the largest batch that fits a budget, with the cheapest verified checkpoint plan.

The library call behind `ckpt-tune search`: load the target, record and solve with `Searcher`
(searcher.py), turn an effective batch into micro-batch × accumulation, and return the plan. The target
is a target string or a `loader.Target` built by the caller (a framework integration's own build, batch
and loss functions).

    import ckpt_tune
    outcome = ckpt_tune.search("examples/gpt.py:build", vram="600MiB")
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ckpt_tune import vocab
from ckpt_tune.errors import CkptTuneError, NoFitError
from ckpt_tune.measure.device import Budget, parse_budget, resolve_device
from ckpt_tune.measure.fake import as_fake_mode_error
from ckpt_tune.measure.loader import Target
from ckpt_tune.measure.session import Settings, build_runner, fake_twin, load, run_of, user_errors
from ckpt_tune.plan.apply import own_checkpointing_paused
from ckpt_tune.plan.file import FULLY_SHARDED, Plan
from ckpt_tune.plan.kinds import KINDS
from ckpt_tune.tune.candidates import find_blocks
from ckpt_tune.tune.search_state import HOST_LINK
from ckpt_tune.tune.searcher import Searcher, SearchResult
from ckpt_tune.tune.sharding import check_shard


@dataclass(frozen=True)
class SearchOutcome:
    plan: Plan
    result: SearchResult
    budget: Budget
    is_hf: bool
    target_batch: int | None = None
    world_size: int = 1  # > 1: every byte figure is per GPU of a sharded run
    shard: str = "none"
    # how the per-GPU figures were obtained: "measured" (rank 0 under the real engine), "arithmetic", "none"
    sharding: str = "none"


def search(
    target: str | Target | None,
    vram: str,
    batch_size: int | None = None,
    target_batch: int | None = None,
    margin: str | None = None,
    settings: Settings = Settings(),
    progress: Callable[[str], None] | None = None,
    world_size: int | None = None,
    shard: str | None = None,
    segments: bool = True,
    candidates: frozenset[str] | None = None,
    fake_probes: bool = True,
    host_link: float = HOST_LINK,
) -> SearchOutcome:
    """Largest batch (or the given one) that fits `vram`, with the cheapest verified checkpoint plan.

    `target`: a target string (docs/design.md §2), a `loader.Target` whose `build_fn`, `batch_fn` and
    `loss_fn` are used as they are (its `spec` is the plan's `target`), or None with `settings.hf_config`.
    `segments`: also consider runs of consecutive blocks under one checkpoint (ckpt_tune/plan/segment.py).
    `candidates`: the kinds of choice the planner may use (plan/kinds/; None: every recompute kind).
    `fake_probes`: on a CPU or CUDA device, record the probes under fake tensors with that allocator's rules
    and run for real only steps within the budget: the user's step once, the step times and the
    verification (docs/design.md §3); False: every step real. `host_link`: bytes/s the transfers of an
    offloaded block are priced at (candidate kind "offload").

    Raises CkptTuneError for a kind refused on the device (offload on the CPU, where host and device
    are the same memory)."""
    t0 = time.perf_counter()
    batch_size, world_size, shard = run_of(settings, batch_size, world_size, shard, default_batch=None)
    t = load(target, settings)
    device = resolve_device(settings.device)
    for kind in (KINDS[name] for name in candidates or ()):
        if (why := kind.refusal(device)) is not None:
            raise CkptTuneError(why, f"plan for a GPU with --device meta (or on it), or leave {kind.name} out of --candidates")
    # --device meta sizes a CUDA step: hold back the CUDA context and margin as on a GPU
    budget = parse_budget(vram, "cuda" if device == "meta" else device, margin)
    world_size, shard = check_shard(world_size, shard)
    # a sharded step is recorded under the real engine, sharded per the planner's blocks (docs/design.md §6)
    model, runner, step = build_runner(t, settings, world_size, shard, units_of=find_blocks)
    built_s = round(time.perf_counter() - t0, 2)
    fixed = batch_size
    if target_batch is not None and batch_size is None:
        fixed = None
    with user_errors("searching"), runner, contextlib.ExitStack() as stack:
        paused = stack.enter_context(own_checkpointing_paused(model))

        def twin():
            probes = stack.enter_context(fake_twin(t, step))
            stack.enter_context(own_checkpointing_paused(probes.model))
            return probes

        def searched(kinds: frozenset[str] | None) -> tuple[Searcher, SearchResult]:
            def searcher_over(probe_runner, real=None) -> Searcher:
                return Searcher(
                    probe_runner, progress=progress, world_size=world_size, shard=shard, segments=segments,
                    candidates=kinds, real=real, host_link=host_link,
                )

            searcher, res, why = None, None, None
            if fake_probes and device in ("cpu", "cuda") and world_size == 1:
                searcher, res, why = _fake_probed(lambda: searcher_over(twin(), runner), budget.usable_bytes, fixed)
            if res is None:
                searcher = searcher_over(runner)
                # fake tensors could not record the step: its probes run on the device, within the budget
                searcher.probes_within_budget = why is not None
                res = searcher.search(budget.usable_bytes, batch_size=fixed)
                if why is not None:
                    res.notes.append(f"every probe ran on the device: under fake tensors {why}")
            return searcher, res

        searcher, res = searched(candidates)
        if fixed is None and not all(e.kind.recomputes for e in res.checkpoint):
            searcher, res = _faster_of(searched, candidates, searcher, res)
        if target_batch is not None:
            res = _fit_target_batch(searcher, res, target_batch, budget.usable_bytes)
        b1, b2 = searcher.b1, searcher.b2
        sizes = searcher.frontier_sizes(res.batch_size)
        res.frontier = searcher.frontier(budget.usable_bytes, sizes, b1, b2, res.batch_size)
        res.frontier = [  # the answer's row is the verified plan
            r if r.batch_size != res.batch_size
            else replace(r, plan=res.checkpoint, predicted_peak=res.predicted_peak, recompute_fraction=res.recompute_fraction, fits=True)
            for r in res.frontier
        ]
        res.notes.extend(n for n in runner.notes if n not in res.notes)
        res.notes.extend(p.note() for p in paused)
        res.stage_seconds = {"build": built_s, **searcher.stage_seconds}
    plan = Plan(
        target=t.spec,
        device=vocab.device_kind(device),
        precision=step.precision,
        optimizer=step.optimizer,
        budget_bytes=budget.usable_bytes,
        batch_size=res.batch_size,
        grad_accum_steps=res.grad_accum_steps,
        seq_len=settings.seq_len if t.is_hf else None,
        peft=settings.peft if t.is_hf else None,
        checkpoint=res.checkpoint,
        predicted_peak_bytes=res.predicted_peak,
        predicted_recompute_fraction=res.recompute_fraction,
        verified_peak_bytes=res.verified_peak,
        first_predicted_peak_bytes=res.first_predicted_peak,
        predicted_from_run=res.resolved,
        world_size=world_size,
        shard=shard,
        # what build_runner sharded (the engine's, recorded) or what the arithmetic assumed: the blocks
        shard_units=tuple(find_blocks(model)) if shard in FULLY_SHARDED else (),
        sharding=searcher.sharding,
    )
    return SearchOutcome(plan, res, budget, t.is_hf, target_batch, searcher.world_size, searcher.shard, searcher.sharding)


def _fake_probed(make: Callable[[], Searcher], budget: int, batch_size: int | None) -> tuple[Searcher | None, SearchResult | None, str | None]:
    """(searcher, result, None) of a search whose probes are recorded under fake tensors; (None, None,
    why) when that failed (fake tensors cannot record a data-dependent op; any failure of ckpt-tune's
    own): a refinement of ours (docs/design.md §8), so the step is searched again with every step on
    the device, where the user's own errors are told as theirs."""
    try:
        searcher = make()
        return searcher, searcher.search(budget, batch_size=batch_size), None
    except (NoFitError, KeyboardInterrupt, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:
        err = as_fake_mode_error(e)
        if err is not None:
            return None, None, err.message
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return None, None, f"the search failed ({type(e).__name__}: {first})".replace(": )", ")")


def _faster_of(searched, candidates: frozenset[str], searcher: Searcher, res: SearchResult) -> tuple[Searcher, SearchResult]:
    """A plan with kinds that do not recompute (offload: modelled transfers, not bounded by a forward)
    may reach a larger batch at a step many times slower: searched again with the recompute kinds only,
    the plan that trains more samples per second (batch / predicted step time) is reported."""
    try:
        other = searched(frozenset(k for k in candidates if KINDS[k].recompute))
    except KeyboardInterrupt:
        raise
    except NoFitError:
        return searcher, res
    except Exception as e:  # a refinement of ours (docs/design.md §8): the plan found stands
        res.notes.append(f"the search without offload, to compare its samples per second, failed: {type(e).__name__}: {str(e)[:160]}")
        return searcher, res
    rate = lambda r: r.batch_size / (1 + r.recompute_fraction)  # noqa: E731
    kept, dropped = (other, res) if rate(other[1]) >= rate(res) else ((searcher, res), other[1])
    kinds = ", ".join(sorted(set(candidates) - {k for k in candidates if KINDS[k].recompute}))
    kept[1].notes.append(
        f"with {kinds}: batch {res.batch_size} at a step {1 + res.recompute_fraction:.2f}x the plain one; "
        f"without: batch {other[1].batch_size} at {1 + other[1].recompute_fraction:.2f}x. Reported: the one that trains "
        f"more samples per second (batch {kept[1].batch_size}; the other's plan was {', '.join(e.label for e in dropped.checkpoint) or 'nothing'})"
    )
    return kept


def _fit_target_batch(searcher: Searcher, res: SearchResult, want: int, budget: int) -> SearchResult:
    """Turn a wanted effective batch into micro-batch × accumulation steps, micro-batch ≤ what fits."""
    if want <= res.batch_size:
        if want == res.batch_size:
            return res
        res = searcher.search(budget, batch_size=want)
        res.notes.append(f"effective batch {want} fits as one micro-batch")
        return res
    # from the second micro-batch on every gradient is live: the micro-batch that fits alone may not
    steps = -(-want // res.batch_size)
    while True:
        while want % steps:
            steps += 1
        micro = want // steps
        searcher.accum_steps = steps
        try:
            out = searcher.search(budget, batch_size=micro)
            break
        except NoFitError:
            if micro == 1:
                raise
            steps += 1
    out.grad_accum_steps = steps
    out.notes.append(f"effective batch {want} = micro-batch {micro} × {steps} accumulation steps")
    return out


def blocks(model: nn.Module) -> list[str]:
    """The checkpoint candidates search would consider for `model`."""
    return find_blocks(model)
