"""Runs of identical blocks are probed on a shortened chain (ckpt_tune/tune/repeats.py); the terms
extended to full depth must equal the terms recorded at full depth, to the byte."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_tune.measure import fake_inputs, loader
from ckpt_tune.measure.forked import WORKERS_ENV
from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.plan.kinds import RECOMPUTE
from ckpt_tune.tune import probing as probing_module
from ckpt_tune.tune.planner import min_peak
from ckpt_tune.tune.repeats import find_repeat
from ckpt_tune.tune.searcher import Searcher

VOCAB, SEQ, DIM = 64, 16, 32


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, DIM))


class MLP(nn.Module):
    def __init__(self, width: int = 4 * DIM) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, width)
        self.down = nn.Linear(width, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, layer_idx: int, width: int = 4 * DIM) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # numbers the layer: not a difference between blocks
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.mlp = nn.LayerNorm(DIM), MLP(width)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, n: int = 8, widths: tuple[int, ...] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(i, (widths or (4 * DIM,) * n)[i]) for i in range(n))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(0))


def loss_fn(model, ids):
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def _runner(device: str, build=Decoder) -> StepRunner:
    if device == "cpu":
        # fp32: under autocast the last block's forward window holds the frees of every block's cast
        # biases (CPU blocks are not rounded), so its F depends on the depth and the search falls back
        return StepRunner(build(), make_batch, loss_fn, StepSettings(device="cpu", precision="fp32"))
    target = loader.Target("decoder", __name__, None, "Decoder", build, make_batch, loss_fn, "make_batch", "loss_fn")
    settings = StepSettings(device="meta", precision="bf16-mixed", fake_target=device)
    return StepRunner(fake_inputs.build_fake_model(target), fake_inputs.fake_batch_fn(target), loss_fn, settings)


def _full_depth(s: Searcher, b: int):
    rep, s.repeat = s.repeat, None
    s.forget_measured()
    try:
        return s.terms(b), (s.costs(b), s.step_ms(b))
    finally:
        s.repeat = rep
        s.forget_measured()


# the CUDA-sized fake run and the CPU-rules fake run are make test-heavy; the real CPU run stays
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.heavy), pytest.param("cpu-fake", marks=pytest.mark.heavy)])
def test_extended_terms_equal_full_depth_terms_to_the_byte(device):
    with _runner("cpu" if device == "cpu" else device.removesuffix("-fake"), Decoder) as runner:
        s = Searcher(runner)
        s.order_units(1)
        assert s.repeat is not None
        assert (s.repeat.first, s.repeat.last) == (0, 7)
        assert s.options[:4] == ("none", "block", "attn", "mlp")
        for b in (1, 3):
            ext, ext_costs = s.terms(b), (s.costs(b), s.step_ms(b))
            assert s.repeat is not None, s.notes
            full, full_costs = _full_depth(s, b)
            assert (ext.static, ext.base, ext.fixed) == (full.static, full.base, full.fixed)
            for i, (e, f) in enumerate(zip(ext.blocks, full.blocks, strict=True)):
                assert (e.d, e.F, e.B) == (f.d, f.F, f.B), f"block {i} at batch {b}"
            if runner.fake:  # FLOPs are exact; CPU wall times are not repeatable
                for e, f in zip(ext_costs[0], full_costs[0], strict=True):
                    assert e == pytest.approx(f, rel=1e-9)
                assert ext_costs[1] == pytest.approx(full_costs[1], rel=1e-9)
        assert s.repeat.extended() == {"layers.5": "layers.1", "layers.6": "layers.2"}


def test_a_chain_of_different_blocks_is_recorded_at_full_depth():
    def build():
        return Decoder(8, widths=(128, 128, 128, 64, 128, 128, 128, 128))

    with _runner("cpu", build) as runner:
        s = Searcher(runner)
        s.order_units(1)
        # the odd block splits the chain into runs of 3 and 4: none long enough
        assert s.repeat is None
        assert find_repeat(runner.model, s.units) is None


def test_full_depth_probes_borrowing_the_optimizer_step_equal_probes_that_record_it(monkeypatch):
    """At full depth only the no-checkpointing probe records the optimizer step; the others take its
    moments (memory_model.with_step_of): the terms are the same to the byte as when each records it
    (a runner of a StepRunner subclass, whose steps the search neither shortens nor shares out, records
    every probe whole). Which op policies are worth a probe is timed on the CPU, so it can differ between
    the two runs on a loaded machine: they are left out, as they are not what is compared."""

    def build():
        return Decoder(8, widths=(128, 128, 128, 64, 128, 128, 128, 128))

    class Whole(StepRunner):
        pass

    steps: list[bool] = []
    measure = StepRunner.measure

    def counted(self, *args, optimizer_step=True, **kwargs):
        steps.append(optimizer_step)
        return measure(self, *args, optimizer_step=optimizer_step, **kwargs)

    monkeypatch.setattr(StepRunner, "measure", counted)
    terms = {}
    for cls in (StepRunner, Whole):
        steps.clear()
        with cls(build(), make_batch, loss_fn, StepSettings(device="cpu", precision="fp32")) as runner:
            s = Searcher(runner, candidates=RECOMPUTE - {"ops"})
            s.order_units(1)
            assert s.repeat is None
            terms[cls] = s.terms(3)
        assert steps.count(False) == (len(steps) - 2 if cls is StepRunner else 0), steps  # ordering and none probe
    borrowed, recorded = terms[StepRunner], terms[Whole]
    assert (borrowed.static, borrowed.base, borrowed.fixed) == (recorded.static, recorded.base, recorded.fixed)
    for i, (b, r) in enumerate(zip(borrowed.blocks, recorded.blocks, strict=True)):
        assert (b.d, b.F, b.B) == (r.d, r.F, r.B), f"block {i}"


@pytest.mark.heavy  # 16 s: two full searches
def test_blocks_that_look_identical_but_record_differently_fall_back(monkeypatch):
    with _runner("cuda") as runner:
        s = Searcher(runner)
        s.order_units(1)
        assert s.repeat is not None
        real_cut = probing_module.cut_run

        def skewed(*a, **k):  # the second middle block stores one byte more
            c = real_cut(*a, **k)
            if len(c.d) == 6:
                d = list(c.d)
                d[2] += 1
                c = type(c)(c.choice, c.base, c.fixed, tuple(d), c.F, c.B, c.peak_above_static, c.before, c.after)
            return c

        monkeypatch.setattr(probing_module, "cut_run", skewed)
        t = s.terms(1)
        assert s.repeat is None
        assert len(t.blocks) == 8
        assert any("recorded at full depth" in n for n in s.notes)


# zero3 has every engine buffer in it (all-gather, reduce-scatter, prefetch); the others: make test-heavy
@pytest.mark.parametrize("shard", [pytest.param("zero1", marks=pytest.mark.heavy), pytest.param("zero2", marks=pytest.mark.heavy), "zero3"])
def test_extended_sharded_terms_equal_full_depth_terms_to_the_byte(shard):
    """Rank 0 of a sharded step (measure/sharded.py) on the shortened chain, extended: the same terms
    as recorded at full depth under the same engine."""
    from ckpt_tune.measure.sharded import ShardedRunner

    units = [f"layers.{i}" for i in range(8)]
    with ShardedRunner(Decoder(), make_batch, loss_fn, StepSettings(device="cpu"), world_size=4, shard=shard, units=units) as runner:
        s = Searcher(runner, world_size=4, shard=shard)
        s.order_units(1)
        assert s.repeat is not None
        for b in (1, 3):
            ext = s.terms(b)
            assert s.repeat is not None, s.notes
            full, _ = _full_depth(s, b)
            assert (ext.static, ext.base, ext.fixed) == (full.static, full.base, full.fixed)
            for i, (e, f) in enumerate(zip(ext.blocks, full.blocks, strict=True)):
                assert (e.d, e.F, e.B) == (f.d, f.F, f.B), f"block {i} at batch {b}"


def test_the_states_after_ordering_are_the_full_models():
    """What ordering leaves behind (the gradients of every block, read by the states-alone answer) is
    the same whether identical blocks are then counted on the shortened chain or not."""
    with _runner("cuda", Decoder) as runner:
        s = Searcher(runner)
        s.order_units(1)
        assert s.repeat is not None
        assert "ops" in s.candidates
        assert len(s.options) > 4  # the op policies were counted, on the shortened chain
        params, grads, _opt = s.states()
        assert grads == sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.requires_grad)
        assert grads == params


def test_progress_names_each_probe_and_the_time_its_probes_have_left(monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "1")  # one process: every probe is this one's
    with _runner("cuda", Decoder) as runner:
        said: list[str] = []
        s = Searcher(runner, progress=said.append)
        s.order_units(1)
        s.terms(1)
    probes = [m for m in said if m.startswith("probing batch 1 on 6 of 8 blocks")]
    n = len(probes)
    assert n == len(s.options) + 2  # none, all, even, odd, and one run per finer option
    assert probes[0].endswith(f"none checkpointed: step 1 of {n}")  # nothing timed yet: no estimate
    assert all(f": step {j} of {n}, about " in m and m.endswith(" s left for these probes") for j, m in enumerate(probes[1:], 2))


@pytest.mark.skipif(sys.platform != "linux", reason="probes are shared out over forked processes on Linux only")
def test_probes_shared_out_over_two_processes_give_the_same_terms(monkeypatch):
    """The probes at a batch recorded by two processes (measure/forked.py): the same terms, to the
    byte, as one process records; every probe is counted and timed; this process names its own."""
    got = {}
    for workers in ("1", "2"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        with _runner("cuda", Decoder) as runner:
            said: list[str] = []
            s = Searcher(runner, progress=said.append)
            s.order_units(1)
            # both small batches: two processes record some of their probes alongside the ordering step
            got[workers] = ((s.terms(1), s.terms(4)), s.runs, len(s.probe_seconds["short"]), said)
    (t4, runs, timed, _), (u4, runs2, timed2, said) = got["1"], got["2"]
    assert t4 == u4
    assert (runs, timed) == (runs2, timed2)
    mine = [m for m in said if m.startswith("probing batch 4 on 6 of 8 blocks") and "(2 processes)" in m]
    assert mine
    assert len(mine) < len(s.options) + 2  # the other process's probes are silent


@pytest.mark.skipif(sys.platform != "linux", reason="probes are shared out over forked processes on Linux only")
def test_first_probes_recorded_alongside_the_ordering_step_are_the_later_ones(monkeypatch):
    """With two processes, a forked one records the first shortened probes while this one records the
    ordering step (probing.ProbeSteps._early_probes): they are kept, and each is the cut one process records."""
    cuts = {}
    for workers in ("2", "1"):
        monkeypatch.setenv(WORKERS_ENV, workers)
        with _runner("cuda", Decoder) as runner:
            s = Searcher(runner)
            s.order_units(1)
            early = dict(s.short_cuts)
            s.terms(1), s.terms(4)
            cuts[workers] = (early, dict(s.short_cuts))
    early, later = cuts["2"]
    # kept: no checkpointing at 1 and 4 at least, then others until the ordering step ended
    assert len(early) >= probing_module.EARLY_PROBES
    none = (0,) * len(s.repeat.short_units)
    assert (1, none) in early
    assert (4, none) in early
    assert not cuts["1"][0]  # one process: nothing is recorded before the ordering step ends
    assert early.items() <= later.items()
    assert later == cuts["1"][1]


@pytest.mark.skipif(sys.platform != "linux", reason="probes are shared out over forked processes on Linux only")
def test_verification_and_frontier_alongside_a_batchs_probes_are_the_ones_run_after(monkeypatch):
    """A settle batch's share-out also verifies the plan fitted terms choose there and solves the
    frontier around it (searcher.prefetch): the verified peak is the one a verification run afterwards
    measures, and frontier() returns the rows it would solve."""
    monkeypatch.setenv(WORKERS_ENV, "2")
    with _runner("cuda", Decoder) as runner:
        s = Searcher(runner)
        s.order_units(1)
        budget = min_peak(s.fitted(8, 1, 4), s.costs(1)).peak
        s.prefetch((8,), timing=(8,), budget=budget)
        (b, choice), peak = next(iter(s.speculated.items()))
        assert b == 8
        sizes = s.frontier_sizes(8)
        cached = s.frontier(budget, sizes, 1, 4, 8)
        s.frontiers.clear()
        assert cached == s.frontier(budget, sizes, 1, 4, 8)
        assert peak == s.verify(8, tuple(s.terms(8).names(choice)), choice)
