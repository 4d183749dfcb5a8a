"""How a `--hf-config` model is fine-tuned: LoRA or QLoRA adapters, as peft and bitsandbytes teach them.

Pure data: `PeftSpec` is what `--peft`, `--lora-r`, `--lora-alpha`, `--lora-dropout` and `--lora-targets`
say, what the plan file records under `peft`, and the code a user pastes to build the same model
(`peft_code`). Building it is measure/peft_model.py's job (docs/design.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tune.errors import CkptTuneError, PlanError

PEFT_METHODS = ("lora", "qlora")
ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head
# The defaults people start from: rank 16 with alpha 2r, the dropout of peft's QLoRA examples.
DEFAULT_R, DEFAULT_ALPHA, DEFAULT_DROPOUT = 16, 32, 0.05


@dataclass(frozen=True)
class PeftSpec:
    """LoRA adapters on a frozen base; for "qlora" the base's linear layers are 4-bit NF4.

    Attributes:
        method: "lora" (the base in bf16, as `from_pretrained(..., dtype=torch.bfloat16)` loads it) or
            "qlora" (bitsandbytes `Linear4bit` NF4 with double quantization and bf16 compute, then
            `prepare_model_for_kbit_training`, which keeps the rest of the base in fp32).
        r, alpha, dropout: `LoraConfig`'s r, lora_alpha and lora_dropout.
        targets: `LoraConfig`'s target_modules: module-name suffixes, or ("all-linear",).
    """

    method: str
    r: int = DEFAULT_R
    alpha: int = DEFAULT_ALPHA
    dropout: float = DEFAULT_DROPOUT
    targets: tuple[str, ...] = (ALL_LINEAR,)

    def __post_init__(self) -> None:
        if self.method not in PEFT_METHODS:
            raise CkptTuneError(f"unknown --peft {self.method!r}", "use one of: lora, qlora")
        if not isinstance(self.r, int) or self.r < 1:
            raise CkptTuneError(f"--lora-r must be a positive integer, got {self.r!r}", "e.g. --lora-r 16")
        if not isinstance(self.alpha, int) or self.alpha < 1:
            raise CkptTuneError(f"--lora-alpha must be a positive integer, got {self.alpha!r}", "e.g. --lora-alpha 32")
        if not 0.0 <= self.dropout < 1.0:
            raise CkptTuneError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}", "e.g. --lora-dropout 0.05")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise CkptTuneError("--lora-targets names no module", "e.g. --lora-targets q_proj,v_proj, or all-linear")

    @property
    def quantized(self) -> bool:
        return self.method == "qlora"

    @property
    def target_modules(self) -> str | list[str]:
        """`LoraConfig(target_modules=...)`: the string "all-linear" or a list of names."""
        return ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)

    def describe(self) -> str:
        base = "4-bit NF4 base (bitsandbytes)" if self.quantized else "bf16 base"
        return f"{self.method}: r={self.r}, alpha={self.alpha}, dropout={self.dropout:g}, targets {','.join(self.targets)}; {base}"

    def to_data(self) -> dict[str, Any]:
        """The plan file's `peft` mapping."""
        return {"method": self.method, "r": self.r, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


def parse_targets(text: str) -> tuple[str, ...]:
    """`--lora-targets q_proj,v_proj` -> ("q_proj", "v_proj"); "all-linear" stays one name."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def from_data(data: Any) -> PeftSpec:
    """A plan file's `peft` mapping read back (a PeftSpec stays as it is); a wrong field is a PlanError naming it."""
    if isinstance(data, PeftSpec):
        return data
    if not isinstance(data, dict):
        raise PlanError(f"peft: expected a mapping, got {type(data).__name__}")
    unknown = set(data) - {"method", "r", "alpha", "dropout", "targets"}
    if unknown:
        raise PlanError(f"peft: unknown key(s) {', '.join(sorted(unknown))}")
    targets = data.get("targets", [ALL_LINEAR])
    if not isinstance(targets, list):
        raise PlanError("peft.targets: expected a list of module names")
    try:
        return PeftSpec(
            method=data.get("method"),
            r=data.get("r", DEFAULT_R),
            alpha=data.get("alpha", DEFAULT_ALPHA),
            dropout=float(data.get("dropout", DEFAULT_DROPOUT)),
            targets=tuple(targets),
        )
    except (CkptTuneError, TypeError, ValueError) as exc:
        raise PlanError(f"peft: {getattr(exc, 'message', exc)}") from exc


def peft_code(spec: PeftSpec, model_id: str = "<your model id>") -> str:
    """The code that loads the model as the plan was measured: paste it where the model is made."""
    targets = repr(spec.target_modules)
    lora = (
        f"lora_config = LoraConfig(r={spec.r}, lora_alpha={spec.alpha}, lora_dropout={spec.dropout:g},\n"
        f"                         target_modules={targets}, task_type=\"CAUSAL_LM\")\n"
    )
    if spec.quantized:
        return (
            "import torch\n"
            "from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training\n"
            "from transformers import AutoModelForCausalLM, BitsAndBytesConfig\n\n"
            "bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\",\n"
            "                                bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)\n"
            f"model = AutoModelForCausalLM.from_pretrained({model_id!r}, quantization_config=bnb_config,\n"
            "                                             dtype=torch.bfloat16)\n"
            "# the plan's checkpointing (below) replaces peft's: keep peft's own off\n"
            "model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)\n"
            + lora
            + "model = get_peft_model(model, lora_config)\n"
        )
    return (
        "import torch\n"
        "from peft import LoraConfig, get_peft_model\n"
        "from transformers import AutoModelForCausalLM\n\n"
        f"model = AutoModelForCausalLM.from_pretrained({model_id!r}, dtype=torch.bfloat16)\n"
        + lora
        + "model = get_peft_model(model, lora_config)\n"
    )
