"""The zoo's members: each a ckpt-tune target (`tests/zoo/<file>.py:<build>`, with `make_batch` and
`loss_fn` beside it, docs/design.md §2) plus its innermost repeated blocks, written by hand from the
architecture (the module-level `BLOCKS` of its file): the reference "every innermost block" plan,
independent of ckpt-tune's own block finder.

    ckpt-tune profile tests/zoo/tv_resnet18.py:build --device cpu --json

`load(member)` imports a target file on its own (not through ckpt_tune's loader), for the harness.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ZOO = Path(__file__).resolve().parent
ROOT = ZOO.parents[1]


@dataclass(frozen=True)
class Member:
    name: str
    file: str  # in tests/zoo/
    build: str = "build"
    family: str = ""
    profile_batch: int = 2  # check 1 and 2: profile against the harness at this batch
    budget_batch: int = 4  # check 3: budget = every-innermost-block peak at this batch + BUDGET_MARGIN
    speed: str = "fast"  # "fast", "slow" (pytest -m slow; in make test) or "heavy" (make zoo only)
    # the same, for the search check: every member's runs in make test (6-45 s each, 4.7 min for the 16 on
    # two cores), the zoo's guard that a search on a model written by others answers a plan within budget
    search_speed: str = "slow"
    # None: --device meta must come within 1% of the CPU allocator. A text: fake tensors cannot run this
    # model, for that reason; `ckpt-tune profile --device meta` must then exit 1 with one clear line.
    # No member has one: every model here can run under fake tensors (hf_mixtral's grouped_mm too).
    meta_limitation: str | None = None

    @property
    def spec(self) -> str:
        """The target as a user passes it, relative to the repository root."""
        return f"tests/zoo/{self.file}:{self.build}"

    @property
    def path_spec(self) -> str:
        return f"{ZOO / self.file}:{self.build}"

    @property
    def blocks(self) -> list[str]:
        return list(load(self).BLOCKS)


MEMBERS: dict[str, Member] = {m.name: m for m in [
    # 11M parameters: 20 s for the profile check alone on the shared 2-core machine (BatchNorm stays in the
    # default run through mobilenet_v3_small)
    Member("tv_resnet18", "tv_resnet18.py", family="torchvision", speed="heavy"),
    Member("tv_mobilenet_v3_small", "tv_mobilenet_v3.py", family="torchvision"),
    Member("tv_convnext", "tv_convnext.py", family="torchvision"),
    Member("tv_vit", "tv_vit.py", family="torchvision"),
    Member("tv_swin", "tv_swin.py", family="torchvision"),
    Member("timm_vit", "timm_vit.py", family="timm"),
    Member("timm_convnext_atto", "timm_convnext.py", family="timm"),
    Member("hf_bert", "hf_bert.py", family="transformers"),
    Member("hf_t5", "hf_t5.py", family="transformers"),
    Member("hf_llama", "hf_llama.py", family="transformers"),
    Member("hf_mistral", "hf_mistral.py", family="transformers"),
    Member("hf_mixtral", "hf_mixtral.py", family="transformers"),
    Member("hf_gpt_neox", "hf_gpt_neox.py", family="transformers"),
    Member("peft_lora_llama", "peft_lora.py", family="peft"),
    Member("lstm_lm", "rnn_lm.py", "build_lstm", family="torch"),
    Member("gru_lm", "rnn_lm.py", "build_gru", family="torch"),
]}

_MODULES: dict[str, ModuleType] = {}


def load(member: Member) -> ModuleType:
    """The member's target file as a module of its own (its sibling `zoo_common` importable)."""
    if member.file not in _MODULES:
        path = ZOO / member.file
        spec = importlib.util.spec_from_file_location(f"zoo_target_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(ZOO))
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.path.remove(str(ZOO))
        _MODULES[member.file] = mod
    return _MODULES[member.file]


def parts(member: Member):
    """(build, make_batch, loss_fn) of the member, for the harness."""
    mod = load(member)
    return getattr(mod, member.build), mod.make_batch, mod.loss_fn
