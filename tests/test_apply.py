"""ckpt_tune.apply: checkpointing changes memory and time only (docs/design.md §5).

Every comparison is against a deep copy of the unwrapped model run with the same seed, on CPU, where
the same ops in the same order give bit-identical results: differences must be exactly 0.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.apply import applied_names, apply, remove
from ckpt_tune.plan.entry import member_names
from ckpt_tune.plan.file import Plan, write_plan
from ckpt_tune.plan.patch import patch_snippet
from tests.harness import one_step

# ---------------------------------------------------------------------------------------------------
# Models (local to this file on purpose: the shared fixtures are written elsewhere)


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn + shortcut (1x1 conv + bn when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), BasicBlock(16, 16, 1))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))  # (B, 16, 8, 8) for a 16x16 input
        return self.fc(x.mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn_drop = nn.Dropout(p)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )  # 3x(B,H,T,hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = self.attn_drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj_drop(self.proj(y))


class ViTBlock(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, p)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(p), nn.Linear(2 * dim, dim), nn.Dropout(p)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)  # 16x16 image -> 4x4 = 16 patches
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 16, dim)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def make_resnet() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return TinyResNet(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))


def make_vit() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return TinyViT(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))


def make_gpt2() -> tuple[nn.Module, tuple]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()  # config warnings about bos/eos ids of the tiny vocab
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    ids = torch.randint(0, 1000, (2, 16))
    return transformers.GPT2LMHeadModel(config), (ids, ids)


def loss_of(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    if x.dtype == torch.long:  # GPT-2: the model computes its own shifted LM loss
        return model(input_ids=x, labels=y).loss
    return F.cross_entropy(model(x), y)


def run_step(model: nn.Module, batch: tuple, seed: int = 1) -> dict:
    """One training forward+backward; everything a plan must leave unchanged (harness.one_step)."""
    return one_step(model, batch, loss_of, seed)


def assert_same_step(got: dict, want: dict) -> None:
    assert torch.equal(got["loss"], want["loss"]), (got["loss"].item(), want["loss"].item())
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        diff = (got["grads"][name] - g).abs().max().item()
        assert diff == 0, f"gradient of {name} differs by {diff}"
    assert got["buffers"].keys() == want["buffers"].keys()
    for name, b in want["buffers"].items():
        assert torch.equal(got["buffers"][name], b), f"buffer {name}: {got['buffers'][name]} != {b}"
    # dropout consumed exactly the same random stream
    assert torch.equal(got["rng"], want["rng"])


BLOCK_NAMES = {
    "resnet": ["blocks.0", "blocks.1", "blocks.2"],
    "vit": ["blocks.0", "blocks.1", "blocks.2"],
    "gpt2": ["transformer.h.0", "transformer.h.1"],
}
MAKERS = {"resnet": make_resnet, "vit": make_vit, "gpt2": make_gpt2}
CASES = [
    ("resnet", ["blocks.1"]),
    ("resnet", BLOCK_NAMES["resnet"]),
    ("resnet", ["blocks.0.bn1", "blocks.1.shortcut", "stem"]),  # a bare BN and a BN-only shortcut
    ("vit", ["blocks.0", "blocks.2"]),
    ("vit", BLOCK_NAMES["vit"]),
    ("vit", ["blocks.1.attn", "blocks.1.mlp"]),
    ("gpt2", ["transformer.h.1"]),
    ("gpt2", BLOCK_NAMES["gpt2"]),
    # segments: consecutive blocks under one checkpoint (ckpt_tune/plan/segment.py)
    ("resnet", [tuple(BLOCK_NAMES["resnet"])]),  # BatchNorm in every block, a shape change inside
    ("vit", ["blocks.0", ("blocks.1", "blocks.2")]),  # dropout: the recompute must repeat its masks
    ("gpt2", [tuple(BLOCK_NAMES["gpt2"])]),  # keyword arguments and tuple outputs between the blocks
    # op-level policies (plan/policy.py): BatchNorm, dropout and Hugging Face layers under each one
    ("resnet", [f"{n}@matmuls" for n in BLOCK_NAMES["resnet"]]),
    ("resnet", ["blocks.0@half-matmuls", "blocks.1", "blocks.2@attention"]),
    ("vit", [f"{n}@half-matmuls" for n in BLOCK_NAMES["vit"]]),
    ("vit", ["blocks.0@attention", "blocks.1@matmuls", "blocks.2"]),
    ("gpt2", [f"{n}@matmuls" for n in BLOCK_NAMES["gpt2"]]),
    ("gpt2", ["transformer.h.0@attention", "transformer.h.1@half-matmuls"]),
]


# ---------------------------------------------------------------------------------------------------
# Same step, bit for bit


@pytest.mark.parametrize(("kind", "names"), CASES)
def test_wrapped_step_equals_unwrapped_step(kind: str, names: list[str]) -> None:
    model, batch = MAKERS[kind]()
    reference = copy.deepcopy(model)
    apply(model, names)
    assert set(applied_names(model)) == set(member_names(names))
    for seed in (1, 2):  # two steps: running stats and the RNG carry over from one to the next
        assert_same_step(run_step(model, batch, seed), run_step(reference, batch, seed))


def test_batchnorm_counts_one_update_per_step() -> None:
    model, batch = make_resnet()
    apply(model, BLOCK_NAMES["resnet"])
    run_step(model, batch)
    run_step(model, batch)
    counts = {n: int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
    assert len(counts) == 8  # stem + 2 per block + the shortcut BN of blocks.1
    assert set(counts.values()) == {2}  # two steps, one update each


def naive_wrap(module: nn.Module) -> None:
    """What most code does: checkpoint the forward with no BatchNorm guard."""
    inner = module.forward

    def forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def test_naive_checkpoint_updates_batchnorm_twice_and_apply_does_not() -> None:
    model, batch = make_resnet()
    naive, guarded = copy.deepcopy(model), copy.deepcopy(model)
    naive_wrap(naive.blocks[1])
    apply(guarded, ["blocks.1"])
    want, bad, good = run_step(model, batch), run_step(naive, batch), run_step(guarded, batch)
    key = "blocks.1.bn1.num_batches_tracked"
    assert (int(want["buffers"][key]), int(bad["buffers"][key]), int(good["buffers"][key])) == (1, 2, 1)
    # the naive recompute moved the running mean a second time (momentum 0.1 applied twice)
    mean = "blocks.1.bn1.running_mean"
    assert not torch.equal(bad["buffers"][mean], want["buffers"][mean])
    assert torch.equal(good["buffers"][mean], want["buffers"][mean])
    # gradients were right in both: the bug is in the statistics only
    assert torch.equal(bad["grads"]["blocks.1.conv1.weight"], want["grads"]["blocks.1.conv1.weight"])


def test_recompute_reproduces_batchnorm_output_bit_for_bit() -> None:
    model, batch = make_resnet()
    apply(model, ["blocks.1"])
    outputs: dict[str, list[torch.Tensor]] = {}
    for name in ("bn1", "bn2", "shortcut.1"):
        bn = model.blocks[1].get_submodule(name)
        bn.register_forward_hook(lambda m, i, o, name=name: outputs.setdefault(name, []).append(o.detach()))
    run_step(model, batch)
    for name, outs in outputs.items():
        assert len(outs) == 2, f"{name} ran {len(outs)} times (forward + recompute expected)"
        assert torch.equal(outs[0], outs[1]), name


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.BatchNorm1d(8),
        lambda: nn.BatchNorm1d(8, momentum=None),  # cumulative average: reads num_batches_tracked
        lambda: nn.InstanceNorm1d(8, affine=True, track_running_stats=True),
        lambda: nn.LazyBatchNorm1d(),
    ],
    ids=["bn", "bn-cumulative", "instancenorm", "lazy-bn"],
)
def test_other_norm_layers_with_running_stats(norm) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(8, 8, 1),
        nn.Sequential(nn.Conv1d(8, 8, 1), norm(), nn.ReLU()),  # input (B, C, L) = (6, 8, 5)
        nn.Flatten(),
        nn.Linear(8 * 5, 3),
    )
    batch = (torch.randn(6, 8, 5), torch.randint(0, 3, (6,)))
    model(batch[0])  # materialise the lazy module before copying
    reference = copy.deepcopy(model)
    apply(model, ["1"])
    for seed in (1, 2):
        assert_same_step(run_step(model, batch, seed), run_step(reference, batch, seed))
    # BatchNorm: the materialising forward + 2 steps; InstanceNorm does not count batches
    expected = 0 if isinstance(model[1][1], nn.InstanceNorm1d) else 3
    assert int(model[1][1].num_batches_tracked) == expected


# ---------------------------------------------------------------------------------------------------
# Checkpointing really happens


def count_calls(model: nn.Module, names: list[str]) -> dict[str, int]:
    """Forward pre-hooks count entries (a recompute may stop early, before a module's forward returns)."""
    counts = dict.fromkeys(names, 0)

    def hook(name):
        def pre(module, args):
            counts[name] += 1

        return pre

    for name in names:
        model.get_submodule(name).register_forward_pre_hook(hook(name))
    return counts


def test_wrapped_blocks_run_twice_and_their_hooks_once() -> None:
    model, batch = make_vit()
    apply(model, ["blocks.0", "blocks.2"])
    inner = count_calls(model, ["blocks.0.norm1", "blocks.1.norm1", "blocks.2.norm1"])
    outer = count_calls(model, ["blocks.0", "blocks.1", "blocks.2"])
    run_step(model, batch)
    # the body of a wrapped block is recomputed in backward; the block's own hooks (FSDP's would be
    # there) are outside the checkpoint and run once
    assert inner == {"blocks.0.norm1": 2, "blocks.1.norm1": 1, "blocks.2.norm1": 2}
    assert outer == {"blocks.0": 1, "blocks.1": 1, "blocks.2": 1}


def test_eval_and_no_grad_forwards_run_plain() -> None:
    model, (x, _) = make_vit()
    reference = copy.deepcopy(model).eval()
    apply(model, BLOCK_NAMES["vit"])
    counts = count_calls(model, ["blocks.0.norm1"])
    model.eval()
    assert torch.equal(model(x), reference(x))
    model.train()
    with torch.no_grad():
        model(x)
    assert counts == {"blocks.0.norm1": 2}  # one per forward, no recompute


def saved_bytes(model: nn.Module, batch: tuple, loss_fn=None) -> int:
    """Unique non-parameter bytes saved for backward by the step, deduplicated by storage."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (loss_fn or loss_of)(model, batch)
    loss.backward()
    return sum(seen.values())


def test_saved_bytes_of_an_mlp_chain_by_hand() -> None:
    b, d = 8, 16
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)) for _ in range(4)]
    )
    batch = (torch.randn(b, d), None)
    act = b * d * 4  # bytes of one (b, d) fp32 activation
    # Per block: the first Linear saves the block input (b, d); the ReLU saves its output h (b, 4d), which
    # is also what the second Linear saves. 4 blocks: 4 * (1 + 4) = 20 activations of (b, d).
    assert saved_bytes(model, batch, lambda m, batch: m(batch[0]).sum()) == 20 * act
    apply(model, ["0", "1", "2"])
    # A checkpointed block keeps only its input (checkpoint saves it for the recompute): 3 * 1;
    # block 3 runs normally: 1 + 4.
    assert saved_bytes(model, batch, lambda m, batch: m(batch[0]).sum()) == 8 * act
    remove(model)
    assert saved_bytes(model, batch, lambda m, batch: m(batch[0]).sum()) == 20 * act


@pytest.mark.parametrize("kind", ["resnet", "vit", "gpt2"])
def test_saved_bytes_shrink_and_remove_restores(kind: str) -> None:
    model, batch = MAKERS[kind]()
    before = saved_bytes(model, batch)
    apply(model, BLOCK_NAMES[kind])
    during = saved_bytes(model, batch)
    assert during < before, (during, before)
    remove(model)
    assert saved_bytes(model, batch) == before


# ---------------------------------------------------------------------------------------------------
# The model stays the same model


def test_names_and_state_dict_unchanged() -> None:
    model, _ = make_resnet()
    names = [n for n, _ in model.named_modules()]
    state = model.state_dict()
    apply(model, BLOCK_NAMES["resnet"])
    assert [n for n, _ in model.named_modules()] == names
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], state[k]) for k in state)
    assert applied_names(model) == tuple(BLOCK_NAMES["resnet"])


def test_remove_restores_original_forwards() -> None:
    model, batch = make_resnet()
    apply(model, ["blocks.0", "blocks.2"])
    remove(model)
    assert applied_names(model) == ()
    assert all(
        "forward" not in m.__dict__ and "_ckpt_inner_forward" not in m.__dict__ for m in model.modules()
    )
    counts = count_calls(model, ["blocks.0.conv1", "blocks.2.conv1"])
    run_step(model, batch)
    assert counts == {"blocks.0.conv1": 1, "blocks.2.conv1": 1}


def test_a_forward_already_set_on_the_instance_is_kept_and_restored() -> None:
    model, batch = make_resnet()
    reference = copy.deepcopy(model)
    block = model.blocks[1]
    calls = []

    def traced(self, x):
        calls.append(1)
        return type(self).forward(self, x)

    traced_forward = functools.partial(traced, block)  # as accelerate's hooks do
    block.forward = traced_forward
    apply(model, ["blocks.1"])
    assert_same_step(run_step(model, batch), run_step(reference, batch))
    assert len(calls) == 2  # forward + recompute, through the user's forward
    remove(model)
    assert block.forward is traced_forward


def test_apply_is_idempotent() -> None:
    model, batch = make_resnet()
    reference = copy.deepcopy(model)
    apply(model, ["blocks.1"])
    apply(model, ["blocks.1"])
    apply(model, ["blocks.1", "blocks.2"])
    assert applied_names(model) == ("blocks.1", "blocks.2")
    counts = count_calls(model, ["blocks.1.conv1"])
    assert_same_step(run_step(model, batch), run_step(reference, batch))
    assert counts == {"blocks.1.conv1": 2}  # wrapped once: a double wrap would recompute again


def test_deepcopy_of_a_wrapped_model_checkpoints_the_copy() -> None:
    model, batch = make_resnet()
    apply(model, ["blocks.1"])
    clone = copy.deepcopy(model)
    assert applied_names(clone) == ("blocks.1",)
    counts = count_calls(clone, ["blocks.1.conv1"])
    original_counts = count_calls(model, ["blocks.1.conv1"])
    run_step(clone, batch)
    assert counts == {"blocks.1.conv1": 2}
    assert original_counts == {"blocks.1.conv1": 0}  # the copy does not call into the original
    assert all(p.grad is None for p in model.parameters())


def test_accepts_plan_file_mapping_and_plan(tmp_path) -> None:
    plan = Plan(
        target="tests/test_apply.py:make_resnet",
        device="cpu",
        precision="fp32",
        optimizer="sgd",
        budget_bytes=None,
        batch_size=4,
        grad_accum_steps=1,
        checkpoint=("blocks.0", "blocks.2"),
        predicted_peak_bytes=1_000_000,
        predicted_recompute_fraction=0.2,
    )
    path = write_plan(plan, tmp_path / "plan.yaml")
    for source in (path, str(path), plan, {**plan.__dict__, "checkpoint": list(plan.checkpoint)}):
        model, _ = make_resnet()
        assert apply(model, source) is model
        assert applied_names(model) == ("blocks.0", "blocks.2")


# ---------------------------------------------------------------------------------------------------
# Plans the model cannot take


def test_refuses_names_the_model_lacks_with_close_matches() -> None:
    model, _ = make_resnet()
    with pytest.raises(PlanError) as err:
        apply(model, ["blocks.1", "block.1", "blocks.7"])
    assert "block.1, blocks.7" in err.value.message
    assert "blocks.1" in err.value.hint
    assert "blocks.0" in err.value.hint
    assert applied_names(model) == ()  # nothing half-applied


def test_lists_at_most_five_missing_names() -> None:
    model, _ = make_resnet()
    with pytest.raises(PlanError, match=r"layer\.0, layer\.1, layer\.2, layer\.3, layer\.4 \(and 2 more\)"):
        apply(model, [f"layer.{i}" for i in range(7)])


def test_refuses_the_root_module() -> None:
    model, _ = make_resnet()
    with pytest.raises(PlanError, match="root module"):
        apply(model, ["", "blocks.0"])


def test_refuses_a_module_with_its_ancestor() -> None:
    model, _ = make_resnet()
    with pytest.raises(PlanError, match=r"'blocks' and 'blocks\.1'"):
        apply(model, ["blocks.1", "blocks"])
    apply(model, ["blocks.1.conv1"])
    with pytest.raises(PlanError, match=r"'blocks\.1' and 'blocks\.1\.conv1'"):
        apply(model, ["blocks.1"])  # an ancestor of a module wrapped earlier


def test_refuses_what_is_not_a_plan() -> None:
    model, _ = make_resnet()
    with pytest.raises(PlanError, match="expected a Plan"):
        apply(model, 42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# Hugging Face: KV cache off while checkpointed, restored by remove


def test_gpt2_use_cache_is_turned_off_and_restored() -> None:
    model, _ = make_gpt2()
    assert model.config.use_cache is True
    apply(model, ["transformer.h.0"])
    assert model.config.use_cache is False
    remove(model)
    assert model.config.use_cache is True


def test_refuses_layers_hugging_face_already_checkpoints() -> None:
    model, _ = make_gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(PlanError, match=r"already on for 'transformer\.h\.0'"):
        apply(model, ["transformer.h.0.mlp"])
    model.gradient_checkpointing_disable()
    apply(model, ["transformer.h.0.mlp"])
    assert applied_names(model) == ("transformer.h.0.mlp",)


# ---------------------------------------------------------------------------------------------------
# The patch snippet does what apply does


def exec_snippet(source: str, model: nn.Module) -> nn.Module:
    namespace = {"model": model}
    exec(compile(source, "<patch snippet>", "exec"), namespace)
    return namespace["model"]


def snippet_plan(names) -> Plan:
    return Plan(
        target="t.py:build",
        device="cpu",
        precision="fp32",
        optimizer="adamw",
        budget_bytes=2**30,
        batch_size=4,
        grad_accum_steps=2,
        checkpoint=tuple(names),
        predicted_peak_bytes=2**29,
        predicted_recompute_fraction=0.25,
    )


@pytest.mark.parametrize(("kind", "names"), CASES)
def test_patch_snippet_matches_apply(kind: str, names: list[str]) -> None:
    model, batch = MAKERS[kind]()
    reference = copy.deepcopy(model)
    applied = apply(copy.deepcopy(model), names)
    patched = exec_snippet(patch_snippet(snippet_plan(names)), model)
    assert patched is model
    assert applied_names(patched) == applied_names(applied)  # apply recognises the snippet's wrappers
    counts = count_calls(patched, member_names(names))
    got = run_step(patched, batch)
    assert_same_step(got, run_step(applied, batch))
    assert_same_step(got, run_step(reference, batch))
    assert set(counts.values()) == {1}
    remove(patched)
    assert applied_names(patched) == ()


def gpt2_layer_calls(model: nn.Module) -> dict[str, int]:
    # ln_1 is the first thing a GPT2Block runs: its pre-hook counts forward + recompute of the layer
    return count_calls(model, [f"transformer.h.{i}.ln_1" for i in range(2)])


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["transformer.h.1"], {"transformer.h.0.ln_1": 1, "transformer.h.1.ln_1": 2}),
        (["transformer.h.0", "transformer.h.1"], {"transformer.h.0.ln_1": 2, "transformer.h.1.ln_1": 2}),
        ([], {"transformer.h.0.ln_1": 1, "transformer.h.1.ln_1": 1}),
    ],
)
def test_hf_patch_snippet_uses_per_layer_switch(names: list[str], expected: dict[str, int]) -> None:
    model, batch = make_gpt2()
    reference = copy.deepcopy(model)
    applied = apply(copy.deepcopy(model), names)
    patched = exec_snippet(patch_snippet(snippet_plan(names), hf=True), model)
    assert applied_names(patched) == ()  # transformers' own switch, not our wrapper
    flags = {n: m.gradient_checkpointing for n, m in patched.transformer.h.named_children()}
    assert flags == {"0": "transformer.h.0" in names, "1": "transformer.h.1" in names}
    assert patched.config.use_cache is False
    counts = gpt2_layer_calls(patched)
    got = run_step(patched, batch)
    assert counts == expected
    assert_same_step(got, run_step(applied, batch))
    assert_same_step(got, run_step(reference, batch))


def test_hf_patch_snippet_falls_back_for_modules_that_are_not_layers() -> None:
    model, batch = make_gpt2()
    reference = copy.deepcopy(model)
    names = ["transformer.h.0.mlp", "transformer.h.1"]
    patched = exec_snippet(patch_snippet(snippet_plan(names), hf=True), model)
    assert applied_names(patched) == tuple(names)  # the plain wrapper
    assert not any(getattr(m, "gradient_checkpointing", False) for m in patched.modules())
    counts = count_calls(
        patched, ["transformer.h.0.mlp.c_fc", "transformer.h.1.ln_1", "transformer.h.0.ln_1"]
    )
    assert_same_step(run_step(patched, batch), run_step(reference, batch))
    assert counts == {"transformer.h.0.mlp.c_fc": 2, "transformer.h.1.ln_1": 2, "transformer.h.0.ln_1": 1}
