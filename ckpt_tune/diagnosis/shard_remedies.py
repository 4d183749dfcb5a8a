"""The sharding remedies of one GPU's diagnosis (docs/design.md §6): `sharding` picks, by arithmetic on
the single-device moments and while the study's runner is open, each stage's fewest GPUs and cheapest
checkpoint plan; `sharded_runs`, once that runner is closed, records each choice as rank 0 of that world
size under the real engine (measure/sharded.py, one fake process group at a time) and verifies its plan
on those recorded steps, as search verifies. On a CUDA device, where that engine cannot run here, the
arithmetic figure stands."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_tune.diagnosis.result import Remedy
from ckpt_tune.diagnosis.study import Names, Study
from ckpt_tune.measure import session
from ckpt_tune.plan.entry import to_data
from ckpt_tune.tune.memory_model import Terms
from ckpt_tune.tune.moments import moments_of
from ckpt_tune.tune.planner import Solution
from ckpt_tune.tune.sharding import Moment, peak_of, per_gpu_terms, shard_moment
from ckpt_tune.tune.verify import DIAGNOSIS_TIGHTENINGS, plan_and_verify, solving, tighten
from ckpt_tune.units import format_bytes

WORLD_SIZES = (2, 4, 8, 16, 32, 64)
SHARD_NAME = {"zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "FSDP / ZeRO-3", "fsdp": "FSDP"}
SHARD_WHAT = {
    "zero1": "optimizer state",
    "zero2": "optimizer state and gradients",
    "zero3": "parameters, gradients and optimizer state",
    "fsdp": "parameters, gradients and optimizer state",
}


MEASURED_WORLD_SIZES = 2  # a sharded run that overshoots its arithmetic is recorded at most at n and 2n


@dataclass(frozen=True)
class ShardChoice:
    """A sharding stage at the fewest GPUs the arithmetic fits (with its cheapest plan then), before it is recorded."""

    stage: str
    n: int
    peak: Moment  # predicted: the single-device moments divided (tune/sharding.py)
    names: Names
    frac: float  # recompute over today's step time
    plan_inputs: tuple[Terms, tuple[tuple[float, ...], ...], float] | None  # one device's terms, costs, step ms


def sharding(study: Study) -> list[ShardChoice]:
    """ZeRO-1, ZeRO-2 and ZeRO-3 each at the fewest GPUs the arithmetic fits (with the cheapest plan that then fits)."""
    inputs = (study.terms(study.b), study.searcher.costs(study.b), study.step_ms()) if study.units else None
    return [ShardChoice(stage, *_shard(study, stage), inputs) for stage in ("zero1", "zero2", "zero3")]


def _shard(study: Study, stage: str) -> tuple[int, Moment, Names, float]:
    base = study.moments(study.b)

    def at(raws, n: int) -> Moment:
        return peak_of(shard_moment(m, n, stage, study.gathered) for m in raws)

    for n in WORLD_SIZES:
        pk = at(base, n)
        if pk.total <= study.usable:
            return n, pk, (), 0.0
        if not study.units:
            continue
        names, cost = study.min_plan()
        smallest = at(study.moments(study.b, names), n)
        if smallest.total <= study.usable:  # some plan fits at this world size: take the cheapest
            cheap = study.cheapest_plan(
                lambda m, n=n: shard_moment(m, n, stage, study.gathered),
                lambda t, n=n: per_gpu_terms(t, study.prof.param_bytes, study.prof.optimizer_bytes, n, stage, study.gathered),
            )
            return (n, *cheap) if cheap is not None else (n, smallest, names, cost / study.step_ms())
    return WORLD_SIZES[-1], at(base, WORLD_SIZES[-1]), (), 0.0


def sharded_runs(study: Study) -> None:
    """The sharding remedies of `sharding`, recorded once the study's runner is closed: rank 0 at the
    chosen world size under the real engine, with the chosen plan (one recorded step when the
    arithmetic was right). Where the engine cannot run (a CUDA device), the arithmetic is the remedy."""
    choices, study.shard_choices = study.shard_choices, []
    if not choices:
        return
    why = _no_engine(study)
    if why is not None:
        study.notes.append(why)
    for c in choices:
        if why is None:
            try:
                study.add(_recorded_shard(study, c))
                continue
            except Exception as e:  # the engine refused this model here: the arithmetic stands, said so
                first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
                study.notes.append(f"{SHARD_NAME[c.stage]} could not be recorded ({type(e).__name__}: {first}); "
                                   "predicted by arithmetic")
        study.add(_shard_remedy(study, c.stage, c.n, c.peak, c.names, c.frac, "predicted (arithmetic)"))


def _no_engine(study: Study) -> str | None:
    """Why the sharded runs cannot be recorded here, or None."""
    device = study.step.device
    if not session.sharded_engine(device, 2):
        return (f"ZeRO-1/2/3 are predicted by arithmetic on the recorded {device} step: the sharding engine runs "
                "under a fake process group on the CPU or under fake tensors (rerun with --device cpu or meta to record them)")
    if study.b in getattr(study.runner, "fake_batches", ()):
        return (f"ZeRO-1/2/3 are predicted by arithmetic: the step at batch {study.b} does not fit this machine's RAM "
                "(--device meta records them under fake tensors)")
    return None


def _recorded_shard(study: Study, c: ShardChoice) -> Remedy:
    """`c` recorded as rank 0 under its engine. When it overshoots, the plan is verified on recorded
    sharded steps (the room tightened by the overshoot, as search does), then one world size up."""
    b, usable = study.b, study.usable
    tried: dict[tuple[int, Names], Moment] = {}
    sizes = [c.n, 2 * c.n][:MEASURED_WORLD_SIZES] if 2 * c.n <= WORLD_SIZES[-1] else [c.n]
    for k, n in enumerate(sizes):
        with study.fresh_runner(world_size=n, shard=c.stage) as r:

            def record(names: Names, n: int = n, r=r) -> Moment:
                if (n, names) not in tried:
                    study.say(f"recording rank 0 of {n} under {c.stage}" + (f", {len(names)} blocks checkpointed" if names else ""))
                    tried[(n, names)] = peak_of(moments_of(r.measure(b, checkpoint=list(names), attribute=True)))
                return tried[(n, names)]

            room = usable
            if k == 0:
                pk = record(c.names)
                if pk.total <= usable:
                    return _shard_remedy(study, c.stage, n, pk, c.names, c.frac, "measured", c)
                room = tighten(usable, c.peak.total, pk.total, usable)
            if c.plan_inputs is not None:
                terms, costs, step_ms = c.plan_inputs
                terms = per_gpu_terms(terms, study.prof.param_bytes, study.prof.optimizer_bytes, n, c.stage, study.gathered)

                def run(sol: Solution) -> tuple[int, Names]:
                    names = study.names(sol.choice)
                    return record(names).total, names

                found = plan_and_verify(solving(terms, costs), usable, run, room, tightenings=DIAGNOSIS_TIGHTENINGS)
                if found is not None:
                    sol, names = found
                    return _shard_remedy(study, c.stage, n, tried[(n, names)], names, sol.cost / step_ms, "measured", c)
            elif k > 0:
                pk = record(())
                if pk.total <= usable:
                    return _shard_remedy(study, c.stage, n, pk, (), 0.0, "measured", c)
    (n, names), pk = min(tried.items(), key=lambda kv: (kv[1].total, kv[0][0]))
    study.notes.append(
        f"{SHARD_NAME[c.stage]}: the arithmetic fit {c.n} GPUs at {format_bytes(c.peak.total)}, but rank 0 recorded under the "
        f"engine stays over the budget up to {sizes[-1]} GPUs (at best {format_bytes(pk.total)})"
    )
    frac = c.frac if (n, names) == (c.n, c.names) else 0.0
    return _shard_remedy(study, c.stage, n, pk, names, frac, "measured", c)


def _shard_remedy(
    study: Study, stage: str, n: int, pk: Moment, names: Names, frac: float, basis: str, predicted: ShardChoice | None = None
) -> Remedy:
    what = SHARD_WHAT[stage]
    title = f"{SHARD_NAME[stage]} over {n} GPUs: {what} divided by {n}"
    if names:
        title += f" + checkpoint {study.ckpt_label(names)}"
    config = {"world_size": n, "shard": stage, "checkpoint": to_data(names)}
    if basis == "measured":
        engine = "ZeroRedundancyOptimizer" if stage == "zero1" else "FSDP2 fully_shard per block" + (
            ", parameters kept gathered from forward to backward" if stage == "zero2" else "")
        assumes = (f"rank 0 of {n} recorded under {engine} (a fake process group on this machine, measure/sharded.py): "
                   "its shards, all-gather and reduce-scatter buffers and the prefetched next block; the same micro-batch "
                   "on each GPU")
        if predicted is not None:  # what tune/sharding.py said, beside the record
            plan = study.ckpt_label(predicted.names) if predicted.names else "no blocks"
            assumes += f"; the arithmetic put {predicted.n} GPUs with {plan} checkpointed at {format_bytes(predicted.peak.total)}"
            config["arithmetic"] = {"world_size": predicted.n, "checkpoint": to_data(predicted.names), "peak_bytes": predicted.peak.total}
    else:
        gathered = f"; plus one block's full parameters ({format_bytes(study.gathered)}) while it runs" if stage == "zero3" else ""
        assumes = f"data parallel, the same micro-batch on each GPU; {what} divided by {n}{gathered}; communication buffers not counted"
    return Remedy(
        stage, title, pk.total, pk.total <= study.usable, basis, pk.where, gpus=n,
        time_overhead=round(frac, 4), keeps_setup=False,
        cost=f"{n} GPUs ({n - 1} more); collectives every step",
        assumes=assumes, config=config,
    )
