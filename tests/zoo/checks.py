"""The zoo's four checks, shared by tests/zoo/test_zoo.py and benchmarks/zoo.py.

Ground truth is tests/harness.py only: a freshly built model, its own checkpoint wrapper, the CPU
allocator's events. ckpt-tune is reached through its public API (`ckpt_tune.profile`, `.search`,
`.apply`) or, with `cli=True`, through the `ckpt-tune` command with `--json`, as a user runs it.

1. profile: ckpt-tune's peak equals the harness's, to the byte.
2. fake: the step recorded under fake tensors with the CPU allocator's rules (what `--device cpu` records
   for a step larger than the machine) within 1% of the harness's CPU-allocator peak; or, for a model
   fake tensors cannot run, `ckpt-tune profile --device meta` exits 1 with one clear line. (`--device
   meta` itself sizes a CUDA step; `fake_peak(m, "cuda")` reports how far that is from the CPU.)
3. search: with the budget set to the every-innermost-block plan's measured peak at `budget_batch` plus
   1%, the plan `search` reports measures within the budget at its batch, and that batch is at least
   the largest at which every innermost block (checkpointed by the harness's wrappers) fits.
4. invariants: `ckpt_tune.apply(copy, plan)` gives the same step as the unwrapped model: gradients
   bit-identical, buffers (BatchNorm statistics) equal, the global RNG state equal afterwards.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from tests.harness import measured_peak, one_step
from tests.zoo.members import MEMBERS, ROOT, Member, parts

META_TOLERANCE = 0.01  # the contract: fake tensors within 1% of the CPU allocator
BUDGET_MARGIN = 0.01  # the search budget: every-innermost-block peak at budget_batch, plus 1%
MAX_BATCH = 256  # the every-innermost-block batch scan stops here


def hashable(entries) -> tuple:
    """Plan entries (names, or lists/tuples of names for segments) as a hashable tuple."""
    return tuple(e if isinstance(e, str) else tuple(e) for e in entries)


@functools.cache
def truth(name: str, batch_size: int, checkpoint: tuple = ()) -> int:
    """The harness's peak of the member at that batch, with `checkpoint` wrapped by its own wrappers."""
    build, make_batch, loss_fn = parts(MEMBERS[name])
    return measured_peak(build, make_batch, loss_fn, batch_size, checkpoint)


def cli(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """`ckpt-tune ARGS` from the repository root, as a user runs it."""
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "ckpt_tune", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def _settings(device: str):
    from ckpt_tune import Settings

    return Settings(device=device)


# -- 1. profile ----------------------------------------------------------------------------------------
def profiled_peak(m: Member, device: str = "cpu", via_cli: bool = False) -> int:
    if via_cli:
        p = cli("profile", m.spec, "--device", device, "--batch-size", str(m.profile_batch), "--json")
        if p.returncode != 0:
            raise RuntimeError(f"ckpt-tune profile exited {p.returncode}: {p.stderr.strip()[-2000:]}")
        return json.loads(p.stdout)["peak_bytes"]
    import ckpt_tune

    return ckpt_tune.profile(m.path_spec, batch_size=m.profile_batch, settings=_settings(device), scaling=False).peak_bytes


# -- 2. meta -------------------------------------------------------------------------------------------
@dataclass
class MetaOutcome:
    peak: int | None  # None: fake tensors could not run it
    error: float | None  # (meta - cpu) / cpu
    stderr: str = ""
    returncode: int = 0


def fake_peak(m: Member, rules: str = "cpu") -> int:
    """Peak of the member's step recorded under fake tensors by ckpt-tune, with an allocator's rules.

    `rules="cpu"` is what `--device cpu` records when a step is larger than the machine (measure/host.py):
    the check of fake mode itself against the CPU allocator. `rules="cuda"` is `--device meta`, which sizes
    a CUDA step (foreach AdamW temporaries, 512 B blocks, no CPU kernel scratch): it differs from the CPU
    allocator by design, and the zoo table reports that difference beside the check."""
    from ckpt_tune.measure import fake_inputs, loader, user_code
    from ckpt_tune.measure.runner import StepRunner, StepSettings

    target = loader.load_target(m.path_spec)
    runner = StepRunner(
        fake_inputs.build_fake_model(target), fake_inputs.fake_batch_fn(target, "cpu"),
        lambda model, batch: user_code.compute_loss(target, model, batch), StepSettings(device="meta", fake_target=rules),
    )
    with runner:
        return runner.measure(m.profile_batch).peak_bytes


def meta_profile_cli(m: Member) -> subprocess.CompletedProcess:
    return cli("profile", m.spec, "--device", "meta", "--batch-size", str(m.profile_batch))


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


# -- 3. search -----------------------------------------------------------------------------------------
def budget(m: Member) -> int:
    every = truth(m.name, m.budget_batch, tuple(m.blocks))
    return every + int(every * BUDGET_MARGIN)


def every_block_batch(m: Member, limit: int) -> int:
    """Largest batch at which checkpointing every innermost block measures ≤ limit (0: none)."""
    blocks = tuple(m.blocks)
    b = m.budget_batch if truth(m.name, m.budget_batch, blocks) <= limit else 0
    while b < MAX_BATCH and truth(m.name, b + 1, blocks) <= limit:
        b += 1
    return b


@dataclass
class SearchOutcome:
    budget: int
    batch_size: int
    grad_accum_steps: int
    checkpoint: tuple
    verified_peak: int | None
    candidates: list[str] = field(default_factory=list)
    seconds: float = 0.0
    largest_real_peak: int | None = None  # the search's largest real recorded step (its probes are fake)


@functools.cache
def searched(name: str, via_cli: bool = False) -> SearchOutcome:
    """ckpt-tune search's plan for the member at its budget (once per session)."""
    import time

    m = MEMBERS[name]
    limit = budget(m)
    t0 = time.perf_counter()
    if via_cli:
        p = cli("search", m.spec, "--device", "cpu", "--vram", str(limit), "--json")
        if p.returncode != 0:
            raise RuntimeError(f"ckpt-tune search exited {p.returncode}: {p.stderr.strip()[-2000:]}")
        out = json.loads(p.stdout)
        plan, candidates = out["plan"], out["candidates"]
        return SearchOutcome(limit, plan["batch_size"], plan["grad_accum_steps"], hashable(plan["checkpoint"]),
                             plan.get("verified_peak_bytes"), candidates, time.perf_counter() - t0,
                             out.get("largest_real_peak_bytes"))
    import ckpt_tune
    from ckpt_tune.plan.entry import plain

    outcome = ckpt_tune.search(m.path_spec, vram=str(limit), settings=_settings("cpu"))
    plan = outcome.plan
    return SearchOutcome(limit, plan.batch_size, plan.grad_accum_steps, plain(plan.checkpoint), plan.verified_peak_bytes,
                         list(outcome.result.units), time.perf_counter() - t0, outcome.result.largest_real_peak)


# -- 4. invariants -------------------------------------------------------------------------------------
def invariant_differences(m: Member, plan) -> list[str]:
    """What differs between a step of the unwrapped model and of a copy with `plan` applied (empty: nothing)."""
    import ckpt_tune

    build, make_batch, loss_fn = parts(m)
    model = build()
    wrapped = copy.deepcopy(model)
    ckpt_tune.apply(wrapped, list(plan))
    batch = make_batch(m.profile_batch)
    want = one_step(model, batch, loss_fn)
    got = one_step(wrapped, batch, loss_fn)
    diffs = []
    if not torch.equal(got["loss"], want["loss"]):
        diffs.append(f"loss {got['loss'].item()!r} != {want['loss'].item()!r}")
    if got["grads"].keys() != want["grads"].keys():
        diffs.append(f"gradients of different parameters: {sorted(got['grads'].keys() ^ want['grads'].keys())[:5]}")
    for n, g in want["grads"].items():
        if n in got["grads"] and not torch.equal(got["grads"][n], g):
            diffs.append(f"gradient of {n} differs by {(got['grads'][n] - g).abs().max().item():.3g}")
    for n, b in want["buffers"].items():
        if not torch.equal(got["buffers"].get(n, torch.empty(0)), b):
            diffs.append(f"buffer {n} differs")
    if not torch.equal(got["rng"], want["rng"]):
        diffs.append("global RNG state differs after the step")
    if any(p.grad is None for p in model.parameters() if p.requires_grad) and not want["grads"]:
        diffs.append("the unwrapped step produced no gradients")
    return diffs
