"""The probe policy on --device cpu: probes under fake tensors, real steps only within the budget.

`search` records its probes under fake tensors with the CPU allocator's rules and runs for real only the
user's step at the first small batch, the step times (at a batch whose plain step fits the budget) and
the verification of the plan it reports (docs/design.md §4). Checked here against the budget, against
the independent harness (tests/harness.py) and against real steps of the same configurations.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckpt_tune import Settings, search
from ckpt_tune.measure import scratch
from ckpt_tune.measure.forked import WORKERS_ENV, cores_left
from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.measure.session import build_runner, fake_twin, load, profile
from ckpt_tune.tune import searcher, step_costs
from ckpt_tune.tune.candidates import find_blocks
from ckpt_tune.tune.memory_model import segments_of
from ckpt_tune.tune.planner import Solution
from ckpt_tune.tune.probing import ProbeSteps
from ckpt_tune.tune.terms import TermStore
from tests import harness
from tests.test_examples import load_example

pytestmark = pytest.mark.slow

GPT = "examples/gpt.py:build"
BUDGET = 160 * 2**20


def real_peaks_of(monkeypatch) -> list[int]:
    """The peaks of the steps `StepRunner.measure` records for real from here on (a cold first step's
    recording calls measure twice: listed twice)."""
    peaks: list[int] = []
    measure = StepRunner.measure

    def counted(self, *a, **k):
        m = measure(self, *a, **k)
        if not self.fake:
            peaks.append(m.peak_bytes)
        return m

    monkeypatch.setattr(StepRunner, "measure", counted)
    return peaks


def test_a_fake_step_counts_the_generator_states_a_checkpoint_keeps() -> None:
    """A checkpoint keeps the CPU generator's state (5,056 B) from its forward to its recompute and
    `fork_rng` copies it again there: a fake step of a checkpointed plan is off from the real one by
    exactly what the plain step is off by (tens of bytes at most), not by 5,056 B per block. A segment,
    which compares the generator's state between its blocks, records under fake tensors too."""
    t = load(GPT, Settings(device="cpu"))
    model, runner, step = build_runner(t, Settings(device="cpu"))
    fake = fake_twin(t, step)
    blocks = find_blocks(model)
    with runner, fake:
        diffs = {}
        segments = [blocks[:3], blocks[3:]]  # a segment compares the generator's state between its blocks
        for name, ck in (("none", []), ("every block", blocks), ("even blocks", blocks[::2]), ("two segments", segments)):
            real = runner.real.measure(3, checkpoint=ck, units=blocks).peak_bytes
            diffs[name] = fake.measure(3, checkpoint=ck, units=blocks).peak_bytes - real
    assert abs(diffs["none"]) <= 64, diffs
    assert diffs["every block"] == diffs["even blocks"] == diffs["two segments"] == diffs["none"], diffs


def test_search_on_cpu_probes_under_fake_tensors_and_runs_real_steps_within_the_budget(monkeypatch) -> None:
    real_peaks: list[int] = []
    fake_steps = [0]
    measure = StepRunner.measure

    def counted(self, *a, **k):
        m = measure(self, *a, **k)
        if self.fake:
            fake_steps[0] += 1
        else:
            real_peaks.append(m.peak_bytes)
        return m

    real_iterations = [0]
    iteration = StepRunner.iteration

    def iterated(self, *a, **k):
        real_iterations[0] += not self.fake
        return iteration(self, *a, **k)

    monkeypatch.setattr(StepRunner, "measure", counted)
    monkeypatch.setattr(StepRunner, "iteration", iterated)
    out = search(GPT, vram="160MiB", settings=Settings(device="cpu"))
    res = out.result
    # every real step recorded in this process (the forked processes' steps are fake) stayed in the budget
    assert real_peaks, "no real step"
    assert max(real_peaks) <= BUDGET, real_peaks
    assert res.real_steps == len(real_peaks)
    assert res.largest_real_peak == max(real_peaks)
    # every other real iteration was timed: three at a batch whose plain step fits (no warm-up, after
    # the user's step), and the every-block floor's, where it ran
    assert res.timed_steps == real_iterations[0] - len(real_peaks) >= 3
    assert res.probes - res.real_steps >= fake_steps[0] > 0
    # the plan reported is verified for real, within the budget, and the prediction was that figure
    assert res.verified_peak <= BUDGET
    assert res.predicted_peak == res.verified_peak
    # ground truth from outside the tool: the allocator's events of the same plan, as the harness runs it
    ex = load_example("gpt")
    got = harness.measured_peak(ex.build, ex.make_batch, ex.loss_fn, res.batch_size, checkpoint=res.checkpoint)
    assert got == res.verified_peak


DATA_DEPENDENT = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            y = torch.relu(self.fc(x))
            return y / (1.0 + y.abs().max().item())  # a value fake tensors cannot know

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    def build():
        torch.manual_seed(0)
        return Net()

    def make_batch(batch_size):
        return torch.randn(batch_size, 64)

    def loss_fn(model, batch):
        return model(batch).pow(2).mean()
    """
)


def test_a_step_fake_tensors_cannot_run_is_searched_with_real_probes(tmp_path, monkeypatch) -> None:
    """A data-dependent op (HF Wav2Vec2ForCTC's CTC loss reads its lengths with .item()): every step runs
    on the device, with a note, and the output counts the real steps and gives the largest one's peak,
    which real probes may take past the budget (docs/limitations.md)."""
    (tmp_path / "dd.py").write_text(DATA_DEPENDENT)
    real_peaks = real_peaks_of(monkeypatch)
    out = search(f"{tmp_path / 'dd.py'}:build", vram="2MiB", settings=Settings(device="cpu"))
    res = out.result
    assert res.real_steps > 1  # (a cold first step's recording calls measure twice: counted once there)
    assert len(real_peaks) - 1 <= res.real_steps <= len(real_peaks)
    assert res.timed_steps is None
    assert res.largest_real_peak == max(real_peaks)
    assert res.verified_peak <= 2 * 2**20
    assert any(n.startswith("every probe ran on the device: under fake tensors") for n in res.notes), res.notes
    monkeypatch.undo()
    cli = subprocess.run([sys.executable, "-m", "ckpt_tune", "search", f"{tmp_path / 'dd.py'}:build", "--device", "cpu",
                          "--vram", "2MiB", "--out", str(tmp_path / "p.yaml")], capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "recorded steps: all real; the largest peaked at" in " ".join(cli.stderr.split()), cli.stderr[-1500:]


WIDE_CONVOLUTIONS = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(512, 512, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x)) + x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(3)))
            self.head = nn.Linear(512 * 4, 10)

        def forward(self, x):
            return self.head(self.blocks(x).flatten(1))

    def build():
        torch.manual_seed(0)
        return Net()

    def make_batch(batch_size):
        return torch.randn(batch_size, 512, 2, 2), torch.randint(0, 10, (batch_size,))

    def loss_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)
    """
)


def test_with_more_torch_threads_kernel_scratch_is_calibrated_here_not_in_a_forked_process(monkeypatch, tmp_path) -> None:
    """oneDNN sizes a kernel's buffers by the threads it runs: the backward of a 512-channel 3x3
    convolution on a 2x2 map holds a weight gradient per thread (torchvision's ResNet-18 at batch 24: a
    step 36 MiB higher on two threads than on one), and a forked process runs one torch thread. With two
    here, every kernel's scratch is calibrated in this process (the first probe of each batch recorded
    here before the others are shared out: probing.py `_first_here`), the forked processes record with
    it, and the plan's predicted peak is its verified one to the byte."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing is forked")
    (tmp_path / "wide.py").write_text(WIDE_CONVOLUTIONS)
    monkeypatch.setenv(WORKERS_ENV, "2")
    calibrate, measure = scratch._calibrate, StepRunner.measure

    def calibrated_by(*a, **k):
        with open(tmp_path / "calibrated_by", "a") as f:  # seen from the forked processes too
            f.write(f"{os.getpid()} {torch.get_num_threads()}\n")
        return calibrate(*a, **k)

    def recorded_by(self, *a, **k):
        if self.fake:
            with open(tmp_path / "recorded_by", "a") as f:
                f.write(f"{os.getpid()}\n")
        return measure(self, *a, **k)

    monkeypatch.setattr(scratch, "_calibrate", calibrated_by)
    monkeypatch.setattr(StepRunner, "measure", recorded_by)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        res = search(f"{tmp_path / 'wide.py'}:build", vram="200MiB", batch_size=8, settings=Settings(device="cpu")).result
    finally:
        torch.set_num_threads(threads)
    assert set((tmp_path / "recorded_by").read_text().split()) - {str(os.getpid())}, "no probe was recorded in a forked process"
    assert set((tmp_path / "calibrated_by").read_text().splitlines()) == {f"{os.getpid()} 2"}
    assert res.verified_peak == res.predicted_peak <= 200 * 2**20


def test_the_fake_twin_of_a_cuda_step_sizes_it_as_device_meta_does() -> None:
    """On a CUDA device the probes are recorded by the same twin with CUDA's allocator rules (512 B
    blocks): the bytes `--device meta` gives, with no GPU needed to build or run it."""
    t = load(GPT, Settings(device="meta"))
    twin = fake_twin(t, StepSettings(device="cuda"))
    assert twin.settings.fake_target == "cuda"
    with twin:
        got = twin.measure(4).peak_bytes
    assert got == profile(GPT, batch_size=4, settings=Settings(device="meta"), scaling=False).peak_bytes


# A fresh interpreter per command: its own peak resident size (getrusage of the process itself), as a
# user's `ckpt-tune` process would have it; forked probe processes are not counted in it.
_PEAK_RSS = (
    "import resource, sys\n"
    "from ckpt_tune.cli import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "finally:\n"
    "    print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
)


def _peak_rss(*args: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _PEAK_RSS, *args], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1], timeout=600)
    line = [x for x in r.stderr.splitlines() if x.startswith("PEAK_RSS_KIB")]
    assert line, r.stderr[-2000:]
    return int(line[-1].split()[1]) * 1024


@pytest.mark.parametrize("target", ["examples/unet.py:build", "examples/resnet.py:build"])
def test_a_search_on_cpu_grows_the_process_by_at_most_112_percent_of_the_budget(target, tmp_path) -> None:
    """The process's peak resident size during `search --device cpu --vram 160MiB` stays within 1.12
    times the budget above a batch-1 profile's of the same model: what real steps free goes back to the
    OS (measure/host.py, bounded_heap), not kept in glibc's heap (2.2 and 2.7 times the budget above the
    profile before). The aim is 1.1; the ResNet search measured 1.102 to 1.108 in the suite
    (docs/limitations.md), so this bound guards the heap, not that aim."""
    profile = _peak_rss("profile", target, "--device", "cpu", "--batch-size", "1")
    searched = _peak_rss("search", target, "--device", "cpu", "--vram", "160MiB", "--out", str(tmp_path / "plan.yaml"))
    assert searched - profile <= 1.12 * BUDGET, (searched - profile) / BUDGET


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_users_step_on_a_cpu_is_one_iteration_recorded_from_cold_at_its_steady_peak(name, monkeypatch) -> None:
    """The user's real step (`Searcher._real_plain`) is recorded from cold, as a fake step is
    (runner.py `measure(cold=True)`: the optimizer state's allocation taken out of the timeline): one
    iteration, not a warm-up and then the recorded one. Its peak is the steady-state iteration's, as
    the independent harness measures it."""
    ex = load_example(name)
    spec = f"examples/{name}.py:build"
    iterations = [0]
    iteration = StepRunner.iteration

    def counted(self, *a, **k):
        iterations[0] += 1
        return iteration(self, *a, **k)

    monkeypatch.setattr(StepRunner, "iteration", counted)
    _model, runner, _step = build_runner(load(spec, Settings(device="cpu")), Settings(device="cpu"))
    with runner:
        m = runner.measure(2, cold=True)
    assert iterations[0] == 1
    assert m.peak_bytes == harness.measured_peak(ex.build, ex.make_batch, ex.loss_fn, 2)


@pytest.mark.hf
def test_the_plan_is_verified_for_real_while_forked_processes_record_the_probes_at_its_batch(monkeypatch) -> None:
    """Probes under fake tensors: the plan that the small batches' terms choose at the first batch probed
    beyond them (HF GPT-2 at 160 MiB: batch 3, segments not offered) is verified for real in this process while
    forked ones record the probes there (probing.py `_verify_beside`), and measures what the harness
    does. Where the probed terms then choose that plan, its verification is the one reported: no
    verification runs after the probes."""
    pytest.importorskip("transformers")
    monkeypatch.setenv(WORKERS_ENV, "2")
    beside = []
    verify = ProbeSteps._verify_beside

    def seen(self, plan):
        peak = verify(self, plan)
        beside.append((plan, peak, os.getpid()))
        return peak

    monkeypatch.setattr(ProbeSteps, "_verify_beside", seen)
    # without segments: a plan with one is learned from its verification, not run ahead (which plan the
    # timings choose varies from run to run on a shared machine)
    res = search("examples/hf_gpt2.py:build", vram="160MiB", settings=Settings(device="cpu"), segments=False).result
    assert len(beside) == 1
    (b, names, _choice), peak, pid = beside[0]
    assert pid == os.getpid()  # a real step: in this process, not a forked one
    ex = load_example("hf_gpt2")
    assert peak == harness.measured_peak(ex.build, ex.make_batch, ex.loss_fn, b, checkpoint=list(names))
    if (b, tuple(names)) == (res.batch_size, tuple(res.checkpoint)):
        assert res.verified_peak == peak <= BUDGET
        assert "verify" not in res.stage_seconds, res.stage_seconds
        assert res.real_steps == 2  # the user's step and this verification
    else:
        assert "verify" in res.stage_seconds


def test_a_plan_guessed_beside_the_probes_runs_for_real_only_where_its_fake_record_fits(monkeypatch) -> None:
    """The plan verified beside the probes is predicted on terms fitted through two small batches, a line
    that can be low (examples/resnet.py on two threads at batch 121: 1.9% over the budget when it ran):
    it is recorded under fake tensors first and runs for real only where that record is within the
    budget (probing.py `_verify_beside`). Forced here: the guess is no checkpointing at the batch
    examples/gpt.py settles on, far over 160 MiB; it is not run, and no real step goes past the budget."""
    monkeypatch.setenv(WORKERS_ENV, "2")
    likely = ProbeSteps._likely_plan
    guessed, said = [], []

    def over(self, b, budget):
        plan = likely(self, b, budget)
        if plan is not None:
            plan = (b, (), (0,) * len(self.units))
            guessed.append(plan)
        return plan

    real_peaks = real_peaks_of(monkeypatch)
    monkeypatch.setattr(ProbeSteps, "_likely_plan", over)
    res = search(GPT, vram="160MiB", settings=Settings(device="cpu"), progress=said.append).result
    assert guessed
    b = guessed[0][0]
    assert f"recording batch {b} with 0 checkpoints under fake tensors, while the probes at that batch run" in said, said
    assert not any(s.startswith(f"verifying batch {b} with 0 checkpoints") for s in said), said
    assert real_peaks
    assert max(real_peaks) <= BUDGET, real_peaks
    assert res.verified_peak <= BUDGET


def test_a_plan_whose_terms_add_up_low_is_recorded_under_fake_tensors_and_not_run_past_the_budget(monkeypatch) -> None:
    """A plan's prediction adds its terms up, and the sum can be low (a diffusers UNet on two threads:
    896 KiB at batch 28, which the real step then held past the budget). Where the probes are fake, the
    plan is recorded under fake tensors before its verification runs for real, and it runs only where
    that record fits (`over_under_fake`); else the planner is tightened by the overshoot. Forced here:
    the first plan solved at the batch examples/gpt.py settles on is no checkpointing, said to fit."""
    monkeypatch.setenv(WORKERS_ENV, "2")
    pav = searcher.plan_and_verify
    lied, said = [], []

    def lying(solve_in, budget, run, **k):
        def solve_low(room):
            sol = solve_in(room)
            if sol is not None and not lied:
                sol = Solution((0,) * len(sol.choice), 0.0, min(sol.peak, room))
                lied.append(sol)
            return sol

        return pav(solve_low, budget, run, **k)

    real_peaks = real_peaks_of(monkeypatch)
    monkeypatch.setattr(searcher, "plan_and_verify", lying)
    res = search(GPT, vram="160MiB", settings=Settings(device="cpu"), progress=said.append).result
    assert lied
    before = [s for s in said if s.endswith("with 0 checkpoints under fake tensors before it runs")]
    assert len(before) == 1, said
    b = int(before[0].split()[2])
    assert not any(s.startswith(f"verifying batch {b} with 0 checkpoints") for s in said), said
    assert real_peaks
    assert max(real_peaks) <= BUDGET, real_peaks
    assert res.verified_peak <= BUDGET
    assert res.checkpoint
    assert not any(n.startswith("a real step held up to") for n in res.notes), res.notes

@pytest.mark.hf
def test_with_one_torch_thread_real_timings_run_beside_the_fake_steps_on_cores_they_leave(monkeypatch, tmp_path) -> None:
    """One torch thread and a core to spare: the op policies are timed in a forked process while this one
    records the ordering step (step_costs.py `policies_ahead`), and the step is timed in this process
    while a forked one records the second small batch's probes (`_time_beside`). The answer is verified
    within the budget and measures what the harness does; the timing the notes name is the one that ran."""
    pytest.importorskip("transformers")
    if cores_left(1) < 1:
        pytest.skip("one core: nothing can run beside a step")
    monkeypatch.setenv(WORKERS_ENV, "2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    timed_here = []
    ratios = step_costs.policy_ratios

    def here(*a, **k):
        timed_here.append(os.getpid())
        with open(tmp_path / "timed_by", "a") as f:  # seen from the forked process too
            f.write(f"{os.getpid()}\n")
        return ratios(*a, **k)

    monkeypatch.setattr(step_costs, "policy_ratios", here)  # the forked process calls it from its copy
    said: list[str] = []
    try:
        res = search("examples/hf_gpt2.py:build", vram="160MiB", settings=Settings(device="cpu"), progress=said.append).result
    finally:
        torch.set_num_threads(threads)
    assert os.getpid() not in timed_here  # the op policies were not timed in this process
    by = (tmp_path / "timed_by").read_text().split()
    assert by, "the op policies were not timed"
    assert str(os.getpid()) not in by  # but in the forked process, whose times the search took
    beside = [s for s in said if s.startswith("timing the step") and "while the probes run" in s]
    assert len(beside) == 1, said
    assert [s for s in said if s.startswith("timing the step")] == beside, said  # not timed again
    at = int(beside[0].split("batch ")[1].split()[0])
    assert any(n.startswith(f"step times measured on the device at batch {at} ") for n in res.notes), res.notes
    assert res.verified_peak <= BUDGET
    ex = load_example("hf_gpt2")
    assert res.verified_peak == harness.measured_peak(ex.build, ex.make_batch, ex.loss_fn, res.batch_size, checkpoint=res.checkpoint)


def test_a_plan_on_estimated_segment_terms_is_recorded_under_fake_tensors_before_it_runs_for_real(monkeypatch) -> None:
    """A segment's terms, before any run of it, are estimated, and an estimate can be low: on
    examples/unet.py at 160 MiB a plan solved on them peaked at 1.06x the budget when it ran for real.
    With probes under fake tensors such a plan is recorded under fake tensors first and solved again on
    what that run measured (`learn_under_fake`); it is not verified beside the probes either: every real
    step of a plan with segments is of a plan solved on measured terms, and within the budget."""
    monkeypatch.setenv(WORKERS_ENV, "2")
    learned, unmeasured = [], []
    verify, learn = TermStore.verify, TermStore.learn_under_fake

    def checked(self, b, names, choice=()):
        t = self.terms(b)
        unmeasured.extend((b, s) for s in segments_of(choice) if self._prev_of(choice, s[0]) not in t.segments[s].measured)
        return verify(self, b, names, choice)

    def seen(self, b, names, choice):
        learned.append((b, choice))
        return learn(self, b, names, choice)

    real_peaks = real_peaks_of(monkeypatch)
    monkeypatch.setattr(TermStore, "verify", checked)
    monkeypatch.setattr(TermStore, "learn_under_fake", seen)
    res = search("examples/unet.py:build", vram="160MiB", settings=Settings(device="cpu")).result
    assert learned, "the search chose no plan with estimated segments: this test checks nothing"
    assert not unmeasured, unmeasured
    assert real_peaks
    assert max(real_peaks) <= BUDGET, real_peaks
    assert res.largest_real_peak <= BUDGET


def test_where_real_steps_hold_more_than_the_fake_probes_saw_the_search_does_not_walk_down_past_the_budget(monkeypatch) -> None:
    """A real step can allocate what fake tensors do not see (torchvision's ResNet-18 held 38.9 MiB above
    its fake-probed prediction at batch 46 while forked processes calibrated kernel scratch on fewer
    threads than its real steps ran: test above, now fixed; a kernel could do the like). The
    first verification that shows it sets the gap (`real_gap`), and the batches below are planned with
    that much less room (`_below`): not one real verification past the budget per batch on the way down.
    Simulated here: every real step of examples/gpt.py at batch 3 or more holds 24 MiB more."""
    hidden = 24 * 2**20
    real_peaks = []
    measure = StepRunner.measure

    def heavier(self, batch_size, *a, **k):
        m = measure(self, batch_size, *a, **k)
        if not self.fake and batch_size >= 3:
            m = dataclasses.replace(m, peak_bytes=m.peak_bytes + hidden)
        if not self.fake:
            real_peaks.append(m.peak_bytes)
        return m

    monkeypatch.setattr(StepRunner, "measure", heavier)
    res = search(GPT, vram="160MiB", settings=Settings(device="cpu")).result
    assert res.verified_peak <= BUDGET
    over = [p for p in real_peaks if p > BUDGET]
    assert len(over) <= 2, real_peaks  # the first verification that finds the gap (and one beside the probes)
    assert any(n.startswith("a real step held up to") for n in res.notes), res.notes
    # the batch the walk down one at a time reaches, after one verification past the budget, not five
    assert res.batch_size == 14
