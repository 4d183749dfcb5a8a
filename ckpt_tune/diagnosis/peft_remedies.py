"""QLoRA and LoRA as people run them, for a `--hf-config` model that does not fit: each recorded.

The model is built again with `--peft qlora` and `--peft lora` (measure/peft_model.py: peft adapters on a
frozen base loaded in bf16, for QLoRA a 4-bit NF4 base) and its step recorded at the diagnosed batch,
under bf16 autocast (what people train these in): first as it is, then, when that does not fit, with
every decoder layer checkpointed. Both are recorded steps, never arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

from ckpt_tune.diagnosis.result import Remedy
from ckpt_tune.diagnosis.study import Study
from ckpt_tune.measure import session
from ckpt_tune.measure.loader import Target, first_line
from ckpt_tune.plan.finetune import PeftSpec
from ckpt_tune.tune.candidates import find_blocks
from ckpt_tune.tune.moments import moments_of
from ckpt_tune.units import format_bytes

_TITLE = {"qlora": "QLoRA: 4-bit NF4 base (bitsandbytes) + LoRA adapters (peft)", "lora": "LoRA adapters (peft) on a bf16 base"}


def peft_remedies(study: Study, target: Target, settings: session.Settings) -> list[Remedy]:
    """The QLoRA and LoRA rows of an HF target trained in full today; [] for any other target."""
    if not target.is_hf or settings.peft is not None or study.n != 1 or not settings.hf_config:
        return []
    out = []
    for method in ("qlora", "lora"):
        spec = PeftSpec(method, r=study.lora_rank, alpha=2 * study.lora_rank)  # diagnose's --lora-rank
        try:
            out.append(_recorded(study, settings, spec))
        except Exception as e:  # a refinement of ours: dropped with a note, the diagnosis goes on
            study.notes.append(f"{method} not recorded: {first_line(e)}")
    return out


def _recorded(study: Study, settings: session.Settings, spec: PeftSpec) -> Remedy:
    precision = "bf16-mixed" if settings.precision == "fp32" else settings.precision
    peft_settings = replace(settings, peft=spec, precision=precision)
    t = session.load(None, peft_settings)
    study.say(f"recording {spec.method} (peft) at batch {study.b}")
    model, runner, _step = session.build_runner(t, peft_settings)
    blocks = tuple(find_blocks(model))
    with runner:
        pk = study.peak(moments_of(runner.measure(study.b, attribute=True)))
        names: tuple[str, ...] = ()
        if pk.total > study.usable and blocks:
            study.say(f"recording {spec.method} (peft) with every decoder layer checkpointed")
            names = blocks
            pk = study.peak(moments_of(runner.measure(study.b, checkpoint=list(names), attribute=True)))
    title = _TITLE[spec.method] + f", r={spec.r} on every linear layer"
    if names:
        title += f" + checkpoint all {len(names)} decoder layers"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return Remedy(
        spec.method, title, pk.total, pk.total <= study.usable, "measured", pk.where, gpus=1,
        time_overhead=None, accuracy="changes what is trained", keeps_setup=False,
        cost=f"trains {trainable / 1e6:.1f}M adapter parameters; the base frozen"
        + (", stored in 4 bits" if spec.quantized else ", in bf16"),
        assumes=f"peft and bitsandbytes as their documentation teaches ({spec.describe()}); {precision}; "
        f"weights and states {format_bytes(pk.params + pk.optimizer)}",
        config={"peft": spec.to_data(), "precision": precision, "checkpoint": list(names),
                "command": f"ckpt-tune search --hf-config {settings.hf_config} --seq-len {settings.seq_len} "
                f"--precision {precision} --peft {spec.method} --vram <your GPU>"},
    )
