"""fake.py: one training iteration under fake tensors, checked against the CPU allocator.

Ground truth is independent of ckpt-tune: tests/harness.py `measured_peak` reads the CPU allocator's
events from `torch.profiler` (profile_memory=True) over a freshly built real model, warm-up iteration
included. The fake side (`fake_measured_peak`) runs the same loop on a fake model under `FakeRecorder`
with the CPU allocator's rules; the two must agree within 1%. Models nobody here wrote are in
tests/test_fake_zoo.py.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ckpt_tune.errors import CkptTuneError, UserCodeError
from ckpt_tune.measure import fake, fake_inputs, fake_ops, loader, timeline, user_code
from ckpt_tune.measure.fake import FakeModeError, FakeRecorder, fake_storage_key
from ckpt_tune.measure.timeline import mark
from tests import harness

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"


# --- tiny models -------------------------------------------------------------------------------


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class MLP(nn.Module):
    def __init__(self, d: int = 64, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        # input size = hidden size: both layers share one signature, so one calibration serves both
        self.lstm = nn.LSTM(64, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 100)

    def forward(self, x):
        return self.head(self.lstm(self.emb(x))[0])


def _ce(model, batch):
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _gpt():
    target = loader.load_target(f"{EXAMPLES / 'gpt.py'}:build")
    cfg = {"n_layer": 2, "n_embd": 48, "n_head": 4, "block_size": 32, "vocab_size": 256}
    return (lambda: target.build_fn(**cfg)), (lambda: target.batch_fn(4, **cfg)), target.loss_fn


def _resnet():
    target = loader.load_target(f"{EXAMPLES / 'resnet.py'}:build")
    cfg = {"image_size": 16, "width": 8, "blocks_per_stage": 1}
    return (lambda: target.build_fn(**cfg)), (lambda: target.batch_fn(4, **cfg)), target.loss_fn


CASES = {
    "mlp": lambda: (MLP, lambda: (torch.randn(16, 64, generator=_gen()), torch.randint(0, 10, (16,), generator=_gen())), _ce),
    "cnn_bn": lambda: (CNN, lambda: (torch.randn(4, 3, 16, 16, generator=_gen()), torch.randint(0, 10, (4,), generator=_gen())), _ce),
    "lstm": lambda: (LSTM, lambda: (torch.randint(0, 100, (4, 16), generator=_gen()), torch.randint(0, 100, (4, 16), generator=_gen())), _ce),
    "gpt": _gpt,
    "resnet": _resnet,
}


# --- the harness ---------------------------------------------------------------------------------

TOLERANCE = 0.01  # fake vs the CPU allocator, relative to the allocator's peak


def _target(build, batch_fn=None) -> loader.Target:
    """A target built by `build` (batches from `batch_fn`), with the model's own loss."""
    return loader.Target(
        spec="t", module_name="t", file_path=None, fn_name="build", build_fn=build, batch_fn=batch_fn,
        loss_fn=None, batch_source="t", loss_source="t",
    )


def fake_measured_peak(build, make_batch, loss_fn, batch_size: int, optimizer: str = "adamw", steps: int = 2) -> int:
    """`harness.measured_peak` with a fake model under `FakeRecorder("cpu")` in place of the profiler.

    The same loop, step for step: the recording starts before the warm-up iteration (optimizer state,
    gradients and batches are born in it), the peak is parameters + buffers + the largest live bytes
    from the second iteration's marker on (the previous gradients are live at the marker).
    """
    target = _target(build, make_batch)
    model = fake_inputs.build_fake_model(target)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    static = _unique_bytes([*model.parameters(), *model.buffers()])
    batch_fn = fake_inputs.fake_batch_fn(target, "cpu")
    with fake.running(), FakeRecorder("cpu") as rec:
        opt = harness.make_optimizer(params, optimizer)
        for i in range(steps):
            if i == 1:
                mark("measured")
            for p in params:
                p.grad = None
            loss = batch = None
            batch = batch_fn(batch_size)
            loss = loss_fn(model, batch)
            loss.backward()
            if opt is not None:
                opt.step()
            del loss, batch
    tl = rec.timeline
    start = tl.marker("measured")
    before = [live for t, live in zip(tl.times, tl.live) if t < start]
    after = [live for t, live in zip(tl.times, tl.live) if t > start]
    return static + max([before[-1] if before else 0, *after])


def assert_fake_matches_allocator(name: str, build, make_batch, loss_fn, batch_size: int) -> None:
    torch.manual_seed(0)
    real = harness.measured_peak(build, make_batch, loss_fn, batch_size)
    predicted = fake_measured_peak(build, make_batch, loss_fn, batch_size)
    err = (predicted - real) / real
    assert abs(err) <= TOLERANCE, f"{name}: fake {predicted:,} vs CPU allocator {real:,} ({err:+.3%})"


def _unique_bytes(tensors) -> int:
    return sum({fake_storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def _with_precision(loss_fn, precision: str):
    if precision != "bf16-mixed":
        return loss_fn

    def amp_loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model, batch)

    return amp_loss


def _bf16_lstm_step() -> None:
    lstm = nn.LSTM(8, 8, num_layers=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lstm(torch.randn(3, 2, 8))[0]
    out.float().sum().backward()


@pytest.mark.parametrize(
    ("case", "precision"),
    [
        ("mlp", "fp32"),
        ("cnn_bn", "fp32"),
        ("cnn_bn", "bf16-mixed"),
        ("lstm", "fp32"),
        pytest.param("lstm", "bf16-mixed", marks=pytest.mark.slow),  # oneDNN's bf16 LSTM: seconds on CPU
        ("gpt", "fp32"),
        ("gpt", "bf16-mixed"),
        pytest.param("resnet", "fp32", marks=pytest.mark.slow),
    ],
)
def test_fake_peak_matches_cpu_allocator(case, precision, require_cpu_kernel):
    if case == "lstm" and precision != "fp32":
        require_cpu_kernel(_bf16_lstm_step, "a bf16 LSTM under autocast")
    build, batch_fn, loss_fn = CASES[case]()
    assert_fake_matches_allocator(f"{case} {precision}", build, lambda _b: batch_fn(), _with_precision(loss_fn, precision), 0)


class Scan(nn.Module):
    """A recurrence over the steps of one tensor (Mamba's sequential scan on a CPU): backward sums the
    gradients of each step's slice into one gradient of the whole tensor."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        a = self.proj(x).sigmoid()
        h = torch.zeros_like(a[:, 0])
        for i in range(a.shape[1]):
            h = a[:, i] * h + a[:, i]
        return h.sum()


class Gather(nn.Module):
    """Relative positions picked with `gather` (Inkling's attention): its backward scatters into zeros."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(32, d)
        self.register_buffer("index", torch.arange(16).repeat(12, 1).unsqueeze(0), persistent=False)

    def forward(self, x):
        a = self.proj(x)
        return torch.gather(a, -1, self.index.expand(a.shape[0], -1, -1)).square().sum()


@pytest.mark.parametrize("build", [Scan, Gather])
def test_what_backward_does_in_place_on_plain_tensors_is_recorded_in_place(build):
    """On plain tensors the engine adds a tensor's second gradient into the first in place, and gather's
    backward scatters into fresh zeros in place; under a dispatch mode both run out of place. Recorded
    as the allocator sees the plain step, to the byte."""
    make_batch = lambda _b: torch.randn(4, 12, 32, generator=_gen())  # noqa: E731
    loss_fn = lambda model, batch: model(batch)  # noqa: E731
    real = harness.measured_peak(build, make_batch, loss_fn, 0)
    assert fake_measured_peak(build, make_batch, loss_fn, 0) == real


def _norm_backward_grads(make):
    """The input gradients of layer, batch and group norm backward, on inputs laid out as models make
    them: a transposed gradient into layer norm (Segformer's patch embedding), channels-last images."""
    aten = torch.ops.aten
    x, g = make(4, 16, 8).transpose(1, 2), make(4, 16, 8).transpose(1, 2)
    w, b = make(16), make(16)
    _, mean, rstd = aten.native_layer_norm.default(x, [16], w, b, 1e-5)
    yield "layer norm", aten.native_layer_norm_backward.default(g, x, [16], mean, rstd, w, b, [True, True, True])[0]
    img = make(4, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    gi, w8, b8 = make(4, 8, 6, 6), make(8), make(8)
    _, m, r = aten.native_group_norm.default(img, w8, b8, 4, 8, 36, 2, 1e-5)
    yield "group norm", aten.native_group_norm_backward.default(gi, img, m, r, w8, 4, 8, 36, 2, [True, True, True])[0]
    rm, rv = make(8), make(8).abs()
    _, sm, si = aten.native_batch_norm.default(img, w8, b8, rm, rv, True, 0.1, 1e-5)
    yield "batch norm", aten.native_batch_norm_backward.default(gi, img, w8, rm, rv, sm, si, True, 1e-5, [True, True, True])[0]


def test_norm_backward_lays_out_the_input_gradient_as_the_kernel_does():
    """A gradient laid out otherwise than the real kernel lays it out makes a later view a copy that the
    real step never makes (a checkpointed Segformer stage was 0.5 MB over its real peak)."""
    real = {name: dx.stride() for name, dx in _norm_backward_grads(lambda *s: torch.randn(*s))}
    with fake.running():
        faked = {name: dx.stride() for name, dx in _norm_backward_grads(lambda *s: torch.randn(*s))}
    assert faked == real


# --- the recorder, by hand ---------------------------------------------------------------------


def test_new_storages_are_allocations_and_their_death_frees():
    with fake.running():
        old = torch.empty(256)  # born before recording: never counted
    with fake.running(), FakeRecorder("cpu") as rec:
        a = torch.empty(1000)  # +1000 * 4
        b = a * 2  # +1000 * 4
        v = b.view(10, 100).t()  # a view: no storage
        old.add_(1)  # in place on an older storage: nothing
        a.mul_(3)  # in place: nothing
        del b, v  # b's storage dies: -4000
        mark("m")
        c = torch.empty(10, dtype=torch.float64)  # +10 * 8
    tl = rec.timeline
    assert tl.deltas == [4000, 4000, -4000, 80]
    assert tl.live == [4000, 8000, 4000, 4080]
    assert tl.times == sorted(tl.times)
    assert tl.times[2] < tl.marker("m") < tl.times[3]
    assert tl.ptrs[0] == fake_storage_key(a)
    assert tl.ptrs[3] == fake_storage_key(c)
    assert tl.ptrs[1] == tl.ptrs[2]  # b's allocation and free name the same storage
    assert isinstance(a, FakeTensor)


def test_only_ops_whose_schema_returns_no_input_storage_skip_the_comparison_with_their_inputs():
    """fake_ops.fresh: an aten op's schema annotates every output that may alias an input and every input
    it writes; such ops, and every op outside aten (a custom op's schema may omit it), are compared."""
    aten = torch.ops.aten
    assert fake_ops.fresh(aten.mm.default)
    assert fake_ops.fresh(aten._to_copy.default)
    assert not fake_ops.fresh(aten.view.default)  # Tensor(a) -> Tensor(a)
    assert not fake_ops.fresh(aten.t.default)
    assert not fake_ops.fresh(aten.add_.Tensor)  # Tensor(a!) self
    assert not fake_ops.fresh(aten.add.out)  # Tensor(a!) out
    assert not fake_ops.fresh(aten.split.Tensor)  # Tensor(a)[]
    importlib.import_module("torch.distributed.fsdp")  # defines fsdp::all_gather_copy_in

    assert not fake_ops.fresh(torch.ops.fsdp.all_gather_copy_in.default)  # returns its input, unannotated


def test_resize_of_a_storage_born_while_recording_counts():
    with fake.running(), FakeRecorder("cpu") as rec:
        a = torch.empty(0)  # no block yet
        b = torch.ones(4)  # +16
        torch.add(b, 1, out=a)  # out= resizes a: +16
        del a  # -16
        torch.ones(3, 3).to_sparse()  # the dense ones: +36, -36; the sparse result: counted, not followed
    assert rec.timeline.deltas == [16, 16, -16, 36, -36]
    assert rec.unmodelled == {"torch.sparse_coo outputs": 1}


def test_cuda_target_rounds_blocks_to_512_bytes():
    with fake.running(), FakeRecorder("cuda") as rec:
        a = torch.empty(10)  # 40 B -> one 512 B block
        b = torch.empty(129)  # 516 B -> 1024 B
        del a, b
    assert rec.timeline.deltas == [512, 1024, -512, -1024]


def test_markers_keep_their_order_and_land_once():
    """Markers reach the fake recorder through timeline's listeners, in order with the storages, once."""
    with fake.running(), FakeRecorder("cpu") as rec:
        timeline.mark("a")
        x = torch.empty(4)
        timeline.mark("b")
        timeline.mark("a")
        del x
    tl = rec.timeline
    assert len(tl.markers["a"]) == 2
    assert len(tl.markers["b"]) == 1
    assert tl.marker("a", 0) < tl.times[0] < tl.marker("b") < tl.marker("a", 1) < tl.times[1]
    assert timeline._LISTENERS == []  # removed on exit


def test_cuda_target_counts_unmodelled_workspaces():
    with fake.running():
        model = CNN()
        x = torch.randn(2, 3, 8, 8)
    with fake.running(), FakeRecorder("cuda") as rec:
        model(x).sum().backward()
    assert rec.unmodelled == {"aten.convolution": 2, "aten.convolution_backward": 2}  # cuDNN workspaces


def test_cpu_target_measures_onednn_lstm_workspace():
    """Fake mode returns an empty oneDNN workspace; the CPU recorder records the real kernel's size."""
    with fake.running():
        lstm = nn.LSTM(8, 16)
        x = torch.randn(5, 2, 8)
    with fake.running(), FakeRecorder("cpu") as rec:
        out, _ = lstm(x)
    with torch.random.fork_rng(devices=[]):
        real_out = nn.LSTM(8, 16)(torch.zeros(5, 2, 8))[0]
    assert rec.unmodelled == {}
    assert rec.nbytes(out) == real_out.untyped_storage().nbytes() == 5 * 2 * 16 * 4
    assert sum(d for d in rec.timeline.deltas if d > 0) > 5 * 2 * 16 * 4 * 3  # output, h, c, workspace


# --- models, batches, errors ------------------------------------------------------------------


def _tiny_llama_config(tmp_path: Path, tied: bool) -> Path:
    cfg = {
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": tied,
    }  # fmt: skip
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(cfg))
    return path


def test_gpt_example_keeps_weights_tied():
    target = loader.load_target(f"{EXAMPLES / 'gpt.py'}:build")
    model = fake_inputs.build_fake_model(target)
    assert isinstance(model.wte.weight, FakeTensor)
    assert model.lm_head.weight is model.wte.weight
    vocab, c = 4096, 192
    assert len({fake_storage_key(p) for p in model.parameters()}) == len(list(model.parameters()))
    assert model.wte.weight.untyped_storage().nbytes() == vocab * c * 4


def test_to_dtype_casts_a_fake_model_and_keeps_ties():
    """`Module.to` fails on fake parameters (it swaps them); `to_dtype` assigns `.data` instead."""
    target = loader.load_target(f"{EXAMPLES / 'gpt.py'}:build")
    model = fake_inputs.to_dtype(fake_inputs.build_fake_model(target), torch.bfloat16)
    assert model.lm_head.weight is model.wte.weight
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.wte.weight.untyped_storage().nbytes() == 4096 * 192 * 2


@pytest.mark.hf
@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_tied_embeddings_stay_tied(tmp_path, tied):
    pytest.importorskip("transformers")
    from ckpt_tune.measure.hf import load_hf_target

    target = load_hf_target(_tiny_llama_config(tmp_path, tied), seq_len=16)
    model = fake_inputs.build_fake_model(target)
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    batch = fake_inputs.fake_batch_fn(target, "cuda")(2)
    assert isinstance(batch["input_ids"], FakeTensor)
    assert batch["input_ids"].shape == (2, 16)
    with fake.running():
        loss = user_code.compute_loss(target, model, batch)
        loss.backward()
    assert model.lm_head.weight.grad.shape == (128, 32)


def test_batch_made_outside_dispatch_is_converted_and_recorded():
    """A make_batch that builds its tensor from numpy gives a real tensor even under the fake mode."""
    np = pytest.importorskip("numpy")
    target = _target(lambda: nn.Linear(8, 2), lambda b: torch.from_numpy(np.zeros((b, 8), dtype=np.float32)))
    batch_fn = fake_inputs.fake_batch_fn(target, "cpu")
    with fake.running(), FakeRecorder("cpu") as rec:
        batch = batch_fn(3)
    assert isinstance(batch, FakeTensor)
    assert rec.timeline.deltas == [3 * 8 * 4]
    assert rec.timeline.ptrs == [fake_storage_key(batch)]


def test_build_allocates_nothing():
    """A 4 GiB layer built under the fake mode costs no memory."""
    target = _target(lambda: nn.Linear(32768, 32768), lambda b: torch.zeros(b, 32768))
    before = _rss()
    model = fake_inputs.build_fake_model(target)
    assert model.weight.untyped_storage().nbytes() == 32768 * 32768 * 4
    assert _rss() - before < 64 << 20


_BUILD_UNDER_A_LIMIT = """
import resource, sys, torch
from torch import nn
from ckpt_tune.measure import fake_inputs, loader
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + (3 << 30), resource.RLIM_INFINITY))
build = lambda: nn.Sequential(*[nn.Linear(16384, 16384) for _ in range(8)])  # 8 GiB of fp32 weights
target = loader.Target(spec="t", module_name="t", file_path=None, fn_name="build", build_fn=build,
                       batch_fn=None, loss_fn=None, batch_source="t", loss_source="t")
model = fake_inputs.build_fake_model(target)
print(sum(p.untyped_storage().nbytes() for p in model.parameters()) >> 30)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_build_holds_one_layer_of_address_space_at_a_time():
    """Under an address-space limit (`ulimit -v`) of 3 GiB above what the process maps, a model of eight
    1 GiB layers is built: each real tensor a constructor makes is freed when its meta copy replaces it."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", _BUILD_UNDER_A_LIMIT], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["8"]


def test_a_buffer_registered_twice_while_alive_is_one_meta_tensor():
    shared = torch.zeros(4)

    def build():
        a, b = nn.Module(), nn.Module()
        a.register_buffer("x", shared)
        b.register_buffer("x", shared)
        return nn.ModuleDict({"a": a, "b": b})

    target = _target(build)
    model = fake_inputs.build_fake_model(target)
    assert model["a"].x is model["b"].x


class _NonzeroModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum()  # boolean indexing: the output's size depends on the data


class _ItemModel(_NonzeroModel):
    def forward(self, x):
        y = self.lin(x)
        return y * y.max().item()


@pytest.mark.parametrize(
    ("model_cls", "op"), [(_NonzeroModel, "aten.nonzero"), (_ItemModel, "aten._local_scalar_dense")]
)
def test_data_dependent_model_raises_fake_mode_error(model_cls, op):
    target = _target(model_cls, lambda b: torch.randn(b, 4))
    model = fake_inputs.build_fake_model(target)
    batch = fake_inputs.fake_batch_fn(target, "cpu")(2)
    # loader wraps the failure in a UserCodeError; running() and FakeRecorder unwrap it
    with pytest.raises(FakeModeError) as info, fake.running(), FakeRecorder("cpu"):
        user_code.compute_loss(target, model, batch)
    err = info.value
    assert isinstance(err, CkptTuneError)
    assert err.message.startswith(f"fake tensors cannot run this model: {op}")
    assert err.hint == "use --device cpu on a smaller config"
    assert isinstance(err.__cause__, UserCodeError)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        pytest.skip("needs /proc/self/statm to read the resident set size")


@pytest.mark.slow
@pytest.mark.hf
def test_llama_7b_builds_and_steps_under_fake_mode_in_little_memory():
    pytest.importorskip("transformers")
    from ckpt_tune.measure.hf import load_hf_target

    before = _rss()
    target = load_hf_target(EXAMPLES / "configs" / "llama-2-7b.json", seq_len=256)
    model = fake_inputs.build_fake_model(target)
    n = 6_738_415_616  # published parameter count
    assert sum(p.numel() for p in model.parameters()) == n
    assert _unique_bytes(model.parameters()) == 4 * n  # fp32, untied lm_head
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=0.0)
    batch_fn = fake_inputs.fake_batch_fn(target, "cuda")
    with fake.running(), FakeRecorder("cuda") as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = user_code.compute_loss(target, model, batch_fn(1))
        loss.backward()
        opt.step()
    assert sum(st["exp_avg"].untyped_storage().nbytes() for st in opt.state.values()) == 4 * n
    assert max(rec.timeline.live) > 3 * 4 * n  # grads, AdamW state and its temporaries, all born here
    assert _rss() - before < 1 << 30, f"RSS grew by {(_rss() - before) / 2**30:.2f} GiB"


if __name__ == "__main__":  # accuracy table: python -m tests.test_fake
    for case in CASES:
        for precision in ("fp32", "bf16-mixed"):
            build, batch_fn, loss_fn = CASES[case]()
            make_batch, loss = (lambda _b, f=batch_fn: f()), _with_precision(loss_fn, precision)
            real = harness.measured_peak(build, make_batch, loss, 0)
            pred = fake_measured_peak(build, make_batch, loss, 0)
            print(f"{case:8s} {precision:10s} CPU {real:>12,d}  fake {pred:>12,d}  {(pred - real) / real:+.3%}", file=sys.stderr)


# --- the first recorded iteration is the steady one ----------------------------------------------------


class LazyCache(nn.Module):
    """Builds a buffer on its first forward and keeps it: its first iteration is not its steady one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()

    def forward(self, x):
        if not hasattr(self, "table"):
            self.register_buffer("table", torch.zeros(4096))
        return self.body(x) + self.table[:10].sum()


def _recorded_steps(build, batch_fn, precision: str = "fp32", optimizer: str = "adamw") -> tuple[int, list]:
    """(iterations run, [timeline deltas, peak, static] of three measured steps) of one fake runner."""
    from ckpt_tune.measure.runner import StepRunner, StepSettings

    target = _target(build, batch_fn)
    model = fake_inputs.build_fake_model(target)
    settings = StepSettings(device="meta", precision=precision, optimizer=optimizer)
    runner = StepRunner(model, fake_inputs.fake_batch_fn(target, "cpu"), _ce, settings)
    calls = []
    iteration = runner.iteration
    runner.iteration = lambda *a, **k: (calls.append(1), iteration(*a, **k))[1]
    with runner:
        steps = [runner.measure(4) for _ in range(3)]
        first = len(calls) - 2
    return first, [(m.timeline.deltas, m.peak_bytes, m.static_bytes) for m in steps]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_first_iteration_is_recorded_as_the_steady_one(optimizer):
    """Under fake tensors the first measure runs no warm-up: its one iteration, less the optimizer state
    its step allocated, is the later iterations' to the byte (AdamW's state is made before the update,
    SGD's momentum during it)."""
    first, steps = _recorded_steps(lambda: MLP(), lambda b: (torch.randn(b, 64, generator=_gen()), torch.randint(0, 10, (b,), generator=_gen())), optimizer=optimizer)
    assert first == 1
    assert steps[0] == steps[1] == steps[2]


def test_a_first_iteration_that_keeps_something_was_the_warm_up():
    """A model that builds a buffer on its first call: that iteration is taken as the warm-up and the
    next one recorded, as every later one is."""
    first, steps = _recorded_steps(LazyCache, lambda b: (torch.randn(b, 64, generator=_gen()), torch.randint(0, 10, (b,), generator=_gen())))
    assert first == 2
    assert steps[0] == steps[1] == steps[2]


def test_flops_are_named_from_the_root_when_the_loss_calls_submodules_directly():
    """A loss that runs `model.blocks(x)` without the root's forward (a Lightning training_step) still
    gets its FLOPs per module under the model's own names, which recompute pricing looks up."""
    from torch import nn

    from ckpt_tune.measure.timing import iteration_flops

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))

    model = Net()

    def iteration(after_forward):
        loss = model.blocks(torch.randn(4, 8)).sum()
        after_forward()
        loss.backward()

    forward, step = iteration_flops(model, iteration)
    assert forward["blocks.0"] == 2 * 4 * 8 * 16 / 1e9
    assert forward["blocks.1"] == 2 * 4 * 16 * 8 / 1e9
    assert step[None] > sum(forward.values())
