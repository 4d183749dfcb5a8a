"""`diagnose`: does the step fit, where is its peak, what is live then, and which remedies make it fit.

    from ckpt_tune.diagnosis import diagnose
    d = diagnose("examples/gpt.py:build", vram="6GiB", batch_size=8)
    d.fits, d.peak.where, [(r.title, r.peak_bytes, r.fits) for r in d.remedies]

One attributed recorded step gives the moments (sharding.Moment: what is live at the largest point of
start, forward, backward and optimizer step). Each remedy is then either measured (checkpoint plans,
smaller micro-batches, bf16 autocast, LoRA, ZeRO-1/2/3: recorded steps with the remedy applied) or
predicted by arithmetic on measured moments (8-bit optimizer, activation offload; sharding on a CUDA
device: tune/sharding.py); `Remedy.basis` says which. Ranking: what fits first; then what keeps what is
trained, fewer GPUs, lower accuracy risk, less extra time (`rank_remedies`).

With `world_size` > 1 on the CPU or under fake tensors (`--device meta`) every step is rank 0's,
recorded under PyTorch's own sharding engine (measure/sharded.py; `Diagnosis.sharding` "measured");
on a CUDA device one device's step is divided by arithmetic ("arithmetic").

One module per stage: study.py records the steps and plans checkpointing on them (`Study`); remedies.py
builds each remedy from a study, shard_remedies.py the sharding ones; lora.py is the LoRA adapter the LoRA remedy records with; result.py
holds the answer (`Diagnosis`, `Remedy`), its ranking and its texts; oom.py reads an OOM message.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ckpt_tune.diagnosis import remedies, shard_remedies
from ckpt_tune.diagnosis.lora import (
    WEIGHT_LAYERS,
    LoRALinear,
    apply_lora,
    lora_applied,
    lora_plan,
    lora_targets,
)
from ckpt_tune.diagnosis.peft_remedies import peft_remedies
from ckpt_tune.diagnosis.result import (
    ACCURACY,
    Diagnosis,
    Remedy,
    no_fit_error,
    rank_remedies,
    states_exceed_text,
    summarize,
)
from ckpt_tune.diagnosis.study import Study
from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure import session
from ckpt_tune.measure.device import parse_budget, resolve_device
from ckpt_tune.tune.candidates import find_blocks
from ckpt_tune.tune.sharding import check_shard

__all__ = [
    "ACCURACY",
    "WEIGHT_LAYERS",
    "Diagnosis",
    "LoRALinear",
    "Remedy",
    "Study",
    "apply_lora",
    "diagnose",
    "lora_applied",
    "lora_plan",
    "lora_targets",
    "no_fit_error",
    "rank_remedies",
    "states_exceed_text",
    "summarize",
]


def diagnose(
    target: str | None,
    vram: str,
    batch_size: int | None = None,
    margin: str | None = None,
    settings: session.Settings | None = None,
    world_size: int | None = None,
    shard: str | None = None,
    lora_rank: int = 8,
    progress: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Measure one step of `target` at `batch_size` against `vram` (per GPU with `world_size`/`shard`),
    and when it does not fit, every remedy's peak, measured where a recorded step can show it."""
    settings = settings or session.Settings()
    batch_size, world_size, shard = session.run_of(settings, batch_size, world_size, shard)
    n, shard = check_shard(world_size, shard)
    if lora_rank < 1:
        raise CkptTuneError(f"--lora-rank must be at least 1, got {lora_rank}", "e.g. --lora-rank 8")
    t = session.load(target, settings)
    device = resolve_device(settings.device)
    budget = parse_budget(vram, device, margin)
    # sharded: rank 0 under the real engine where it runs, sharded per the planner's blocks (docs/design.md §6)
    model, runner, step = session.build_runner(t, settings, n, shard, units_of=find_blocks)
    study = Study(model, runner, step, t.spec, batch_size, budget, n, shard, lora_rank, progress)
    try:
        _run(study)
        if not study.fits:  # QLoRA and LoRA as people run them, for an HF config trained in full
            found = peft_remedies(study, t, settings)
            if found:  # they replace the LoRA row of ckpt-tune's own adapter (an fp32 base under autocast)
                study.remedies = [r for r in study.remedies if r.kind != "lora"]
            study.add(*found)
    except CkptTuneError as e:
        if isinstance(e.__cause__, (MemoryError, torch.OutOfMemoryError)):
            # the device cannot hold the step it is asked about: measure where memory is plentiful
            raise CkptTuneError(e.message, "run diagnose with --device cpu: it measures the same step exactly, "
                                "and the budget stays the GPU's") from e
        raise
    return study.result()


def _run(study: Study) -> None:
    with session.user_errors("diagnosing"):
        with study.recording():
            study.start()
            if not study.fits:
                remedies.single_gpu_remedies(study)
        if not study.fits:  # remedies that run the step under other settings, each with its own runner
            study.add(remedies.mixed_precision(study), remedies.lora(study))
            remedies.eight_bit_recorded(study)
            shard_remedies.sharded_runs(study)
