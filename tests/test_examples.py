"""The bundled examples and the test zoo honour the target contract of docs/design.md §2: `build()` gives a
module, `make_batch(b)` is deterministic and leaves the global RNG alone, `loss_fn` gives a finite
scalar whose backward reaches every trainable parameter."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from tests.fixtures.models import (
    ADAPTER_LAYERS,
    ADAPTER_RANK,
    ADAPTER_WIDTH,
    FP32,
    LINEAR_LAYERS,
    LINEAR_WIDTH,
    REPO_ROOT,
    ZOO,
    write_target_file,
)

EXAMPLES = REPO_ROOT / "examples"


def load_example(name: str) -> ModuleType:
    # Loaded the way a file target may be: from its path, and without registering it in
    # sys.modules, which dataclasses under `from __future__ import annotations` would need.
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensors_of(batch: object) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for key in sorted(batch) for t in tensors_of(batch[key])]
    if isinstance(batch, tuple | list):
        return [t for item in batch for t in tensors_of(item)]
    raise TypeError(f"unexpected batch element {type(batch).__name__}")


def check_target(build, make_batch, loss_fn) -> None:
    """The contract, checked on one target namespace."""
    rng_before = torch.get_rng_state()
    model = build()
    first, second = make_batch(2), make_batch(2)
    assert torch.equal(torch.get_rng_state(), rng_before), "build/make_batch changed the global RNG"

    assert isinstance(model, nn.Module)
    a, b = tensors_of(first), tensors_of(second)
    assert len(a) == len(b) > 0
    assert all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(x.shape[0] == 2 for x in a), [tuple(x.shape) for x in a]
    assert all(x.device.type == "cpu" for x in a)

    # Two builds give the same weights: plans can be compared across fresh models.
    again = build().state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())

    model.train()
    loss = loss_fn(model, first)
    assert loss.dim() == 0
    assert loss.is_floating_point()
    assert torch.isfinite(loss)
    loss.backward()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []


# --------------------------------------------------------------------------------------------------
# examples/


@pytest.mark.parametrize("name", ["gpt", "resnet", "unet"])
def test_example_honours_contract(name: str) -> None:
    ex = load_example(name)
    check_target(ex.build, ex.make_batch, ex.loss_fn)


def test_hf_gpt2_honours_contract() -> None:
    pytest.importorskip("transformers")
    ex = load_example("hf_gpt2")
    check_target(ex.build, ex.make_batch, ex.loss_fn)
    model = ex.build()
    assert model.config.use_cache is False
    batch = ex.make_batch(2)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (2, ex.N_POSITIONS)


def test_hf_gpt2_without_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import transformers` raise ImportError.
    monkeypatch.setitem(sys.modules, "transformers", None)
    ex = load_example("hf_gpt2")  # importing the file itself must still work
    with pytest.raises(RuntimeError, match=r"needs transformers: pip install 'ckpt-tune\[hf\]'"):
        ex.build()
    assert tensors_of(ex.make_batch(1))[0].shape == (1, ex.N_POSITIONS)


def test_gpt_shapes_and_tied_head() -> None:
    gpt = load_example("gpt")
    cfg = gpt.GPTConfig()
    model = gpt.build()
    idx, targets = gpt.make_batch(3)
    assert idx.shape == targets.shape == (3, cfg.block_size)
    assert idx.dtype == targets.dtype == torch.long
    assert torch.equal(idx[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    assert model.lm_head.weight is model.wte.weight
    assert len(model.blocks) == cfg.n_layer
    assert {n for n, _ in model.blocks[0].named_children()} == {"ln_1", "attn", "ln_2", "mlp"}
    # 12 C^2 + 13 C per block (qkv, proj, fc, proj weights and biases, two LayerNorms), the token
    # table (shared with the head), the position table and the final LayerNorm.
    C, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    assert sum(p.numel() for p in model.parameters()) == L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C
    with torch.no_grad():
        assert model(idx).shape == (3, cfg.block_size, cfg.vocab_size)


def test_gpt_build_overrides() -> None:
    gpt = load_example("gpt")
    small = gpt.build(n_layer=2, n_embd=64, n_head=2, block_size=16, vocab_size=50)
    assert len(small.blocks) == 2
    assert small.wte.weight.shape == (50, 64)
    idx, targets = gpt.make_batch(2, block_size=16, vocab_size=50)
    assert idx.shape == (2, 16)
    assert int(idx.max()) < 50
    assert torch.isfinite(gpt.loss_fn(small, (idx, targets)))
    with pytest.raises(TypeError, match="n_layers"):
        gpt.build(n_layers=2)


def test_resnet_and_unet_shapes() -> None:
    resnet, unet = load_example("resnet"), load_example("unet")
    r = resnet.build()
    assert [len(getattr(r, f"layer{i}")) for i in range(1, 5)] == [2, 2, 2, 2]
    images, labels = resnet.make_batch(2)
    assert images.shape == (2, 3, 64, 64)
    assert labels.shape == (2,)
    with torch.no_grad():
        assert r.eval()(images).shape == (2, 10)
    u = unet.build()
    images, masks = unet.make_batch(2)
    assert masks.shape == (2, 64, 64)
    with torch.no_grad():
        assert u.eval()(images).shape == (2, unet.UNetConfig().num_classes, 64, 64)


# --------------------------------------------------------------------------------------------------
# tests/fixtures/models.py


REQUIRED = {
    "linear_stack",
    "mlp_blocks",
    "cnn_bn",
    "unet_skips",
    "lstm_tied",
    "frozen_adapter",
    "vit_dropout",
    "dict_batch",
    "tuple_output",
}


def test_zoo_has_the_required_models() -> None:
    assert set(ZOO) >= REQUIRED
    assert all(name == f.name for name, f in ZOO.items())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_fixture_honours_contract(name: str) -> None:
    f = ZOO[name]
    check_target(f.build, f.make_batch, f.loss_fn)
    if f.chain is not None:
        assert len(list(f.build().get_submodule(f.chain).children())) >= 2


def saved_bytes_by_module(model: nn.Module, run) -> dict[str, int]:
    """Unique non-parameter storages saved for backward, by innermost running module ("" = none)."""
    stack: list[str] = []
    owner: dict[int, tuple[str, int]] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def enter(name: str):
        return lambda module, args: stack.append(name)

    def leave(module: nn.Module, args: object, output: object) -> None:
        stack.pop()  # returns None: a forward hook that returns a value replaces the output

    handles = []
    for mod_name, mod in model.named_modules():
        if mod_name:
            handles.append(mod.register_forward_pre_hook(enter(mod_name)))
            handles.append(mod.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            owner.setdefault(storage.data_ptr(), (stack[-1] if stack else "", storage.nbytes()))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    totals: dict[str, int] = {}
    for mod_name, nbytes in owner.values():
        totals[mod_name] = totals.get(mod_name, 0) + nbytes
    return totals


@pytest.mark.parametrize("batch", [1, 8])
def test_linear_stack_saves_exactly_its_inputs(batch: int) -> None:
    f = ZOO["linear_stack"]
    model, x = f.build(), f.make_batch(batch)
    saved = saved_bytes_by_module(model, lambda: f.loss_fn(model, x))
    expected = {f"layers.{i}": batch * LINEAR_WIDTH * FP32 for i in range(LINEAR_LAYERS)}
    expected[""] = batch * LINEAR_WIDTH * FP32  # the loss's pow saves the model's output
    assert saved == expected
    assert sum(v for k, v in saved.items() if k) == batch * LINEAR_WIDTH * FP32 * LINEAR_LAYERS


def test_frozen_adapter_trains_only_the_adapters() -> None:
    model = ZOO["frozen_adapter"].build()
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_a." in n or ".lora_b." in n for n in trainable)
    assert sum(trainable.values()) == ADAPTER_LAYERS * 2 * ADAPTER_WIDTH * ADAPTER_RANK


def test_lstm_decoder_is_tied_to_embedding() -> None:
    model = ZOO["lstm_tied"].build()
    assert model.decoder.weight is model.embed.weight
    # named_parameters() lists a shared parameter once
    assert sum(1 for n, _ in model.named_parameters() if n.endswith(".weight") and "lstm" not in n) == 1


def test_vit_dropout_is_random_in_train_and_not_in_eval() -> None:
    f = ZOO["vit_dropout"]
    model, batch = f.build(), f.make_batch(2)
    torch.manual_seed(1)
    l1 = f.loss_fn(model, batch)
    l2 = f.loss_fn(model, batch)
    assert not torch.equal(l1, l2)  # dropout draws a fresh mask each call
    model.eval()
    assert torch.equal(f.loss_fn(model, batch), f.loss_fn(model, batch))


def test_default_loss_rule_fixtures_produce_what_the_rule_reads() -> None:
    dict_f, obj_f, scalar_f, tuple_f = (
        ZOO[n] for n in ("dict_batch", "object_output", "scalar_output", "tuple_output")
    )
    assert all(f.default_loss_rule for f in (dict_f, obj_f, scalar_f, tuple_f))
    assert not ZOO["linear_stack"].default_loss_rule

    m, batch = dict_f.build(), dict_f.make_batch(2)
    assert isinstance(batch, dict)
    assert torch.equal(m(**batch)["loss"], dict_f.loss_fn(m, batch))

    m, batch = obj_f.build(), obj_f.make_batch(2)
    assert torch.equal(m(*batch).loss, obj_f.loss_fn(m, batch))

    m, batch = scalar_f.build(), scalar_f.make_batch(2)
    assert m(*batch).dim() == 0

    m, x = tuple_f.build(), tuple_f.make_batch(2)
    out = m(x)
    assert isinstance(out, tuple)
    assert [t.is_floating_point() for t in out] == [True, True, False]
    assert torch.equal(out[0].sum() + out[1].sum(), tuple_f.loss_fn(m, x))


def test_write_target_file_exposes_the_contract(tmp_path: Path) -> None:
    target = write_target_file(tmp_path, "linear_stack")
    path, fn = target.rsplit(":", 1)
    assert fn == "build"
    assert Path(path).parent == tmp_path
    spec = importlib.util.spec_from_file_location("linear_stack_target", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build is ZOO["linear_stack"].build
    check_target(module.build, module.make_batch, module.loss_fn)

    # A default-loss-rule fixture leaves loss_fn out, so the tool's own rule is exercised.
    path = write_target_file(tmp_path, "tuple_output").rsplit(":", 1)[0]
    assert "loss_fn" not in Path(path).read_text()


def test_target_file_loads_from_another_directory(tmp_path: Path) -> None:
    # A CLI run in a subprocess does not have the repository root on sys.path; the file adds it.
    path = write_target_file(tmp_path, "mlp_blocks").rsplit(":", 1)[0]
    code = (
        f"import runpy; ns = runpy.run_path({path!r}); m = ns['build'](); b = ns['make_batch'](2); "
        "print(float(ns['loss_fn'](m, b)) > 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
