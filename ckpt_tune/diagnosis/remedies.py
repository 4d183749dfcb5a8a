"""The remedies, each built from a `Study`: measured (checkpoint plans, smaller micro-batches, bf16
autocast, LoRA, sharded data parallelism: recorded steps with the remedy applied) or predicted by
arithmetic on measured moments (8-bit optimizer, activation offload; sharding where its engine cannot
run: tune/sharding.py). Each returns its Remedy, or None with a note on the study when it does not apply.

The sharding remedies are in shard_remedies.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

from torch import nn

from ckpt_tune import vocab
from ckpt_tune.diagnosis import shard_remedies
from ckpt_tune.diagnosis.lora import lora_applied, lora_plan
from ckpt_tune.diagnosis.result import Remedy
from ckpt_tune.diagnosis.study import Names, Study
from ckpt_tune.measure.loader import first_line
from ckpt_tune.measure.tensors import local_tensor, storage_key
from ckpt_tune.plan.entry import to_data
from ckpt_tune.tune.memory_model import policy_options, price_out
from ckpt_tune.tune.moments import moments_of
from ckpt_tune.tune.planner import Solution, min_peak
from ckpt_tune.tune.sharding import (
    LoraPlan,
    Moment,
    accumulate_moment,
    eight_bit_moment,
    eight_bit_state_bytes,
    lora_moment,
    offload_moment,
)
from ckpt_tune.tune.verify import DIAGNOSIS_TIGHTENINGS, plan_and_verify, solving
from ckpt_tune.units import format_bytes, format_percent

PCIE_BYTES_PER_S = 25e9  # PCIe 4.0 x16, one direction, as measured by bandwidthTest on pinned memory


def single_gpu_remedies(study: Study) -> None:
    """Every remedy recorded with the study's own runner (open), in order. For one GPU, the sharded runs
    are chosen here (arithmetic) and recorded by `shard_remedies.sharded_runs` once the runner is closed."""
    basis = "measured + arithmetic" if study.sharding == "arithmetic" else "measured"
    if study.units:
        study.add(*checkpoint(study, basis))
    study.floor = floor(study, basis)
    study.add(micro_batch(study), eight_bit(study), offload(study))
    if study.n == 1:
        study.shard_choices = shard_remedies.sharding(study)
    if study.units:  # recorded now, while the searcher's runner is open: LoRA's estimate composes with it
        study.moments(study.b, study.min_plan()[0])


def checkpoint(study: Study, basis: str) -> list[Remedy]:
    """The cheapest checkpoint plan that fits; when it holds op-level policies, also the cheapest plan
    of whole modules alone (what checkpointing without policies would cost), ranked beside it."""
    names, cost, pk = study.fit_plan(study.b)
    out = [_checkpoint_remedy(study, basis, names, cost, pk)]
    if any(e.policy is not None for e in names):
        whole = study.fit_plan(study.b, terms_fn=lambda t: price_out(t, policy_options(t)))
        out.append(_checkpoint_remedy(study, basis, *whole))
    return out


def _checkpoint_remedy(study: Study, basis: str, names, cost: float, pk) -> Remedy:
    frac = cost / study.step_ms()
    shown = ": " + ", ".join(e.label for e in names) if 0 < len(names) <= 4 else ""
    policies = sorted({e.policy for e in names if e.policy is not None})
    how = f" (op policies {', '.join(policies)} on some)" if policies else ""
    return Remedy(
        "checkpoint", f"checkpoint {study.ckpt_label(names)}{how}{shown}", pk.total, pk.total <= study.usable, basis,
        pk.where, gpus=study.n, time_overhead=round(frac, 4),
        cost=f"recompute: {format_percent(frac, 0, signed=True)} step time",
        assumes="non-reentrant torch.utils.checkpoint on the named blocks (ckpt_tune.apply)"
        + (", selective for the op policies (plan/policy.py)" if policies else "")
        + "; placement by the exact planner",
        config={"checkpoint": to_data(names), "batch_size": study.b},
    )


def floor(study: Study, basis: str) -> Remedy:
    """The smallest peak at batch 1: with the smallest-peak checkpoint plan where there are blocks."""
    if study.units:
        mp = min_peak(study.terms(1), study.searcher.costs(1))
        names = study.names(mp.choice)
        title = f"with {study.ckpt_label(names)} checkpointed at batch 1"
    else:
        names, title = (), "at batch 1"
    pk = study.peak(study.moments(1, names))
    return Remedy("floor", title, pk.total, pk.total <= study.usable, basis, pk.where, gpus=study.n,
                  config={"checkpoint": to_data(names), "batch_size": 1})


def micro_batch(study: Study) -> Remedy | None:
    b = study.b
    if b == 1:
        study.notes.append("batch 1 already: no smaller micro-batch")
        return None
    acc = lambda m: accumulate_moment(m, study.prof.grad_bytes, study.in_flight)  # noqa: E731
    chosen: tuple[int, Names, float, Moment] | None = None
    for mb in [d for d in range(b - 1, 0, -1) if b % d == 0][:6]:
        chosen = (mb, (), 0.0, study.peak(study.moments(mb), acc))
        if chosen[3].total <= study.usable:
            break
    else:
        if study.units:
            names, cost, pk = study.fit_plan(1, accumulate=True)
            if pk.total <= study.usable:
                chosen = (1, names, cost, pk)
    assert chosen is not None
    mb, names, _cost, pk = chosen
    k = b // mb
    # timed back to back (the same machine load for both), the micro-step with its plan applied
    t_b = study.runner.time_step(b, repeats=3).step_ms
    t_m = study.runner.time_step(mb, checkpoint=list(names), repeats=3).step_ms
    overhead = max(0.0, k * t_m / t_b - 1)
    bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in study.model.modules())
    title = f"micro-batch {mb} × {k} accumulation steps (effective batch {b})"
    if names:
        title += f" + checkpoint {study.ckpt_label(names)}"
    return Remedy(
        "micro-batch", title, pk.total, pk.total <= study.usable, "measured + arithmetic", pk.where, gpus=study.n,
        time_overhead=round(overhead, 4), accuracy="low" if bn else "none",
        cost=f"{k} sequential micro-steps: {format_percent(overhead, 0, signed=True)} step time (timed here)"
        + ("; BatchNorm statistics over micro-batches" if bn else ""),
        assumes="a recorded step at the micro-batch, plus the gradients summed so far live through every "
        "later micro-step's forward and backward (added in place; one layer's new gradients in flight)",
        config={"batch_size": mb, "grad_accum_steps": k, "checkpoint": to_data(names)},
    )


def eight_bit(study: Study) -> Remedy | None:
    opt = vocab.optimizer(study.step.optimizer)
    if opt.states_per_param == 0:
        study.notes.append(f"optimizer {opt.name} keeps no state: an 8-bit optimizer saves nothing")
        return None
    if opt.eight_bit is None:
        study.notes.append(f"optimizer {opt.name} has no 8-bit version in bitsandbytes: not considered")
        return None
    new = eight_bit_state_bytes(_state_numels(study), opt.name)
    start = study.raw[(study.b, ())][0]
    saved = study.per_gpu(start).optimizer - study.per_gpu(eight_bit_moment(start, new)).optimizer
    pk, names, frac = study.compose(
        lambda m: eight_bit_moment(m, new), lambda t: replace(t, static=t.static - saved, measured={})
    )
    cls = f"bitsandbytes.optim.{opt.eight_bit}"
    title = f"8-bit optimizer state ({cls})"
    if names:
        title += f" + checkpoint {study.ckpt_label(names)}"
    return Remedy(
        "8bit-optimizer", title, pk.total, pk.total <= study.usable, "predicted (arithmetic)", pk.where, gpus=study.n,
        time_overhead=round(frac, 4), accuracy="low", keeps_setup=False,
        cost=f"optimizer state {format_bytes(study.prof.optimizer_bytes)} → {format_bytes(new)}; quantized moments",
        assumes="bitsandbytes' layout: 1 byte per state value and an fp32 absmax per 256; tensors under 4096 "
        "values keep 32-bit state; the step's scratch as measured for torch's optimizer",
        config={"optimizer": cls, "optimizer_bytes": new, "checkpoint": to_data(names)},
    )


def _state_numels(study: Study) -> list[int]:
    """Values of each tensor with optimizer state on this GPU (tied weights once): every trainable
    parameter on one device; rank 0's shard of each (fully_shard) or its partition (ZeRO-1) when sharded."""
    params = [p for p in study.model.parameters() if p.requires_grad]
    if study.sharding == "measured":
        opt = study.runner.optimizer  # open: the sharded runner's (ZeroRedundancyOptimizer: its local one)
        inner = getattr(opt, "optim", opt)
        params = [p for g in inner.param_groups for p in g["params"] if p.requires_grad] if inner is not None else []
    return list({storage_key(p): local_tensor(p).numel() for p in params}.values())


def offload(study: Study) -> Remedy:
    prof = study.prof
    rec = {r.name: r for r in prof.modules}
    work = max([rec[u].subtree_activation_bytes for u in study.units if u in rec]
               or [r.activation_bytes for r in prof.modules] or [0])
    pk = study.peak(study.moments(study.b), lambda m: offload_moment(m, work))
    moved = prof.activation_total_bytes
    ms = 2 * moved / PCIE_BYTES_PER_S * 1e3
    return Remedy(
        "offload", "offload saved activations to CPU memory (torch.autograd.graph.save_on_cpu(pin_memory=True))",
        pk.total, pk.total <= study.usable, "predicted (arithmetic)", pk.where, gpus=study.n, time_overhead=None,
        cost=f"{format_bytes(moved)} to the host and back each step: ≈{ms:.1f} ms at 25 GB/s, hidden only behind enough compute",
        assumes=f"the GPU keeps one block's saved activations ({format_bytes(work)}) at a time; not measurable "
        "on CPU, where host and device memory are the same",
        config={"working_set_bytes": work, "host_bytes": moved},
    )


# -- remedies that run the step under other settings, each with its own runner -------------------------


def eight_bit_recorded(study: Study) -> None:
    """The 8-bit optimizer row recorded where bitsandbytes' optimizer runs here (AdamW, one device):
    the step with `adamw-8bit` and the row's checkpoint plan replaces the arithmetic (it runs on the CPU
    and under fake tensors). Left as arithmetic, with a note, where it cannot be recorded."""
    import importlib.util

    row = next((r for r in study.remedies if r.kind == "8bit-optimizer"), None)
    if row is None or study.step.optimizer != "adamw" or study.sharding != "none":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        study.notes.append("8-bit optimizer: bitsandbytes is not installed here, its row is arithmetic")
        return
    step = study.step
    names = row.config.get("checkpoint") or []
    study.say("recording with bitsandbytes' AdamW8bit" + (f", {len(names)} modules checkpointed" if names else ""))
    try:
        with study.fresh_runner(replace(step, optimizer="adamw-8bit")) as r:
            m = r.measure(study.b, checkpoint=list(names), attribute=True)
    except Exception as e:  # a refinement of ours: the arithmetic row stays, with a note
        study.notes.append(f"8-bit optimizer not recorded ({first_line(e)}): arithmetic row kept")
        return
    pk = study.peak(moments_of(m))
    recorded = replace(
        row, peak_bytes=pk.total, fits=pk.total <= study.usable, basis="measured", peak_where=pk.where,
        cost=f"optimizer state {format_bytes(study.prof.optimizer_bytes)} → {format_bytes(m.optimizer_bytes)}; quantized moments",
        assumes=f"bitsandbytes.optim.AdamW8bit recorded (the arithmetic said {format_bytes(row.peak_bytes)})",
        config={**row.config, "optimizer_bytes": m.optimizer_bytes, "arithmetic_bytes": row.peak_bytes},
    )
    study.remedies = [recorded if r is row else r for r in study.remedies]


def mixed_precision(study: Study) -> Remedy | None:
    step = study.step
    if step.precision != "fp32":
        study.notes.append(f"precision is {step.precision} already: no autocast remedy")
        return None
    settings = replace(step, precision="bf16-mixed")
    # under fully_shard, bf16-mixed is FSDP2's MixedPrecisionPolicy (measure/sharded.py), not autocast
    policy = study.sharding == "measured" and study.shard != "zero1"
    study.say("recording with " + ("FSDP2's bf16 MixedPrecisionPolicy" if policy else "bf16 autocast"))
    with study.fresh_runner(settings) as r:
        pk = study.peak(moments_of(r.measure(study.b, attribute=True)))
    if policy:
        title = "bf16 mixed precision (--precision bf16-mixed: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))"
        assumes = "fully_shard gathers the fp32 shards as bf16 and reduces gradients in fp32; fp32 shards, gradients and optimizer state kept"
    else:
        title = "bf16 autocast (--precision bf16-mixed; fp16-mixed saves the same, with a GradScaler)"
        assumes = "torch.autocast: fp32 weights, gradients and optimizer state kept"
    return Remedy(
        "mixed-precision", title,
        pk.total, pk.total <= study.usable, "measured + arithmetic" if study.sharding == "arithmetic" else "measured", pk.where,
        gpus=study.n, accuracy="low", cost="bf16 matmuls and saved activations; usually faster on tensor-core GPUs",
        assumes=assumes,
        config={"precision": "bf16-mixed"},
    )


def lora(study: Study) -> Remedy | None:
    """Measured with the adapters applied (lora_applied), alone or with the smallest-peak checkpoint
    plan when only that fits; the arithmetic estimate (sharding.lora_moment) is kept beside it."""
    plan = lora_plan(study.model, study.prof, study.units, study.lora_rank)
    if plan is None or not plan.trainable_param_bytes:
        study.notes.append("no Linear layers to adapt: LoRA not considered")
        return None
    fn = lambda m: lora_moment(m, plan)  # noqa: E731
    estimate = study.peak(study.moments(study.b), fn)  # arithmetic, LoRA alone: shown beside the record
    basis, alone = ("measured + arithmetic" if study.sharding == "arithmetic" else "measured"), None
    try:
        with _lora_recorder(study, plan) as record:
            pk = alone = record(())
            names, frac = (), 0.0
            if pk.total > study.usable and study.units:
                found = _lora_with_plan(study, plan, record)
                if found is not None:
                    pk, names, frac = found
    except Exception as e:  # a model whose code reads the wrapped layers' attributes directly
        (pk, names, frac), basis = study.compose(fn), "predicted (arithmetic)"
        study.notes.append(f"LoRA could not be applied for a recorded step ({type(e).__name__}: {e}); arithmetic estimate shown")
    where = " of the blocks" if study.units else ""
    title = f"LoRA rank {plan.rank} on {len(plan.adapted)} Linear layers{where}, everything else frozen"
    if names:
        title += f" + checkpoint {study.ckpt_label(names)}"
    check = (
        f"; without checkpointing it records {format_bytes(alone.total)} against {format_bytes(estimate.total)} "
        "estimated by arithmetic (sharding.lora_moment)" if alone is not None else ""
    )
    return Remedy(
        "lora", title, pk.total, pk.total <= study.usable, basis, pk.where, gpus=study.n,
        time_overhead=round(frac, 4), accuracy="changes what is trained", keeps_setup=False,
        cost=f"trains {format_bytes(plan.adapter_param_bytes)} of adapters instead of {format_bytes(plan.trainable_param_bytes)}",
        assumes="ckpt_tune.diagnosis.apply_lora: adapters on the named layers, every other parameter frozen" + check,
        config={"lora_rank": plan.rank, "adapted": list(plan.adapted), "checkpoint": to_data(names),
                "alone_measured_bytes": alone.total if alone is not None else None,
                "alone_arithmetic_bytes": estimate.total},
    )


def _lora_with_plan(study: Study, plan: LoraPlan, record: Callable[[Names], Moment]) -> tuple[Moment, Names, float] | None:
    """The cheapest checkpoint plan that fits with the adapters: planned on terms whose static part
    loses the frozen weights' optimizer state (gradients are left in: the safe side), each candidate
    recorded with the adapters applied; else the smallest-peak plan if that fits."""
    start = study.raw[(study.b, ())][0]
    before, after = study.per_gpu(start), study.per_gpu(lora_moment(start, plan))
    saved = before.params + before.optimizer - after.params - after.optimizer
    terms, costs = replace(study.terms(study.b), measured={}), study.searcher.costs(study.b)
    terms = replace(terms, static=terms.static - saved)
    step = study.step_ms()

    def run(sol: Solution) -> tuple[int, tuple[Names, Moment]]:
        names = study.names(sol.choice)
        pk = record(names)
        return pk.total, (names, pk)

    found = plan_and_verify(solving(terms, costs), study.usable, run, tightenings=DIAGNOSIS_TIGHTENINGS)
    if found is not None:
        sol, (names, pk) = found
        return pk, names, sol.cost / step
    names, cost = study.min_plan()
    pk = record(names)
    return (pk, names, cost / step) if pk.total <= study.usable else None


@contextlib.contextmanager
def _lora_recorder(study: Study, plan: LoraPlan) -> Iterator[Callable[[Names], Moment]]:
    """The adapters applied and one runner open on them (sharded like the study's): `record(names)` is the
    per-GPU peak of the step with those blocks checkpointed."""
    with lora_applied(study.model, plan.rank, plan.adapted), study.fresh_runner() as r:

        def record(names: Names) -> Moment:
            study.say("recording with LoRA adapters" + (f", {len(names)} blocks checkpointed" if names else ""))
            return study.peak(moments_of(r.measure(study.b, checkpoint=list(names), attribute=True)))

        yield record
