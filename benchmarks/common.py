"""Shared pieces of the benchmarks: the example targets, the ground-truth harness, timing, and the
writer of `results/<name>.json` / `<name>.md`.

Ground truth never comes from ckpt-tune itself. `measured_peak` is tests/harness.py's, the one the test
suite uses, and shares no code with ckpt_tune.measure.runner: a freshly built model, the profiler started before the warm-up
iteration (so gradients, optimizer state, the batch and activations are all seen from their allocation
on), gc collected before and disabled during, and the peak of the measured iteration is the bytes of
parameters and buffers plus the largest running sum of the CPU allocator's `[memory]` events inside it
(docs/design.md §3). Checkpointing is applied by the harness's own wrappers, not by ckpt_tune.plan.apply.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the profiler warns about pre-existing blocks

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MiB = 1 << 20

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ckpt_tune.plan.entry import plain  # noqa: E402,F401  (re-exported for the benchmarks)
from tests import harness  # noqa: E402  (the ground truth the test suite uses)
from tests.harness import Segment, make_optimizer, wrap_blocks  # noqa: E402


# -- targets -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    """An example target: its spec for ckpt-tune and its own build/make_batch/loss_fn for the harness."""

    name: str
    spec: str  # what a user passes to ckpt-tune, relative to the repository root
    build: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


def import_example(path: Path):
    """An example file as module `bench_<stem>`, registered in sys.modules (once): dynamo (the
    torch.compile peer) re-imports the module of every function it inlines."""
    name = f"bench_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def example(name: str) -> Example:
    mod = import_example(ROOT / "examples" / f"{name}.py")
    return Example(name, f"examples/{name}.py:build", mod.build, mod.make_batch, mod.loss_fn)


EXAMPLES = ("gpt", "resnet", "unet", "hf_gpt2")


# -- checkpoint wrappers (independent of ckpt_tune.apply) ------------------------------------------
def wrap_segments(model: nn.Module, units: Sequence[str], segments: Sequence[tuple[int, int]], checkpoint: Sequence[bool]) -> None:
    """Run each [start, end) range of `units` as one segment, checkpointed as ONE unit where asked.

    The first block of a segment runs the whole segment (its own hooks still fire once); the others
    pass their input through. Valid only where nothing but the blocks runs between the first and the
    last block of a segment: GPT, HF GPT-2 and ResNet, not the U-Net, whose forward pools and keeps skips
    between stages (SEGMENT_CHAIN_OK)."""
    for (start, end), ck in zip(segments, checkpoint, strict=True):
        mods = [model.get_submodule(u) for u in units[start:end]]
        Segment(mods, ck).install()


SEGMENT_CHAIN_OK = {"gpt": True, "hf_gpt2": True, "resnet": True, "unet": False}


def sqrt_segments(n: int, segments: int | None = None) -> list[tuple[int, int]]:
    """The split `torch.utils.checkpoint.checkpoint_sequential(functions, segments, input)` makes of n
    blocks: `segments - 1` segments of floor(n / segments) blocks each, and the remainder in the last one
    (which it runs without checkpointing). `segments` defaults to round(sqrt(n)), Chen et al.'s sqrt(n)."""
    k = max(1, min(n, segments if segments is not None else round(n**0.5)))
    size = n // k
    cuts = [(s, s + size) for s in range(0, size * (k - 1), size)]
    return [*cuts, (size * (k - 1), n)]


# -- the harness ----------------------------------------------------------------------------------------
def measured_peak(
    ex: Example,
    batch_size: int,
    checkpoint: Sequence = (),
    wrap: Callable[[nn.Module], None] | None = None,
    optimizer: str = "adamw",
    steps: int = 2,
) -> int:
    """tests/harness.py's ground truth for an example target (see its `measured_peak`)."""
    return harness.measured_peak(
        ex.build, ex.make_batch, ex.loss_fn, batch_size, checkpoint, optimizer, wrap=wrap, steps=steps
    )


# -- timing -------------------------------------------------------------------------------------------
class TimedModel:
    """One model instance with its own optimizer, for interleaved step timing of several plans."""

    def __init__(self, ex: Example, checkpoint: Sequence[str] = (), wrap: Callable[[nn.Module], None] | None = None) -> None:
        self.ex = ex
        self.model = ex.build()
        self.model.train()
        if checkpoint:
            wrap_blocks(self.model, checkpoint)
        if wrap is not None:
            wrap(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = make_optimizer(params, "adamw")
        self.params = params

    def step(self, batch_size: int) -> float:
        for p in self.params:
            p.grad = None
        t0 = time.perf_counter()
        batch = self.ex.make_batch(batch_size)
        loss = self.ex.loss_fn(self.model, batch)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0


def interleaved_samples(
    models: dict[Any, TimedModel], batch_size: int | dict[Any, int], repeats: int, target_s: float = 0.0, max_repeats: int = 41
) -> dict[Any, list[float]]:
    """Step seconds per plan, `repeats` each (more, up to `max_repeats`, until the first plan has run for
    `target_s`); plans alternate within each repeat, in reversed order every other repeat, so that machine
    load hits all alike. `batch_size`: one for all, or one per key."""
    sizes = batch_size if isinstance(batch_size, dict) else dict.fromkeys(models, batch_size)
    first = next(iter(models))
    warm = {}
    for k, m in models.items():
        warm[k] = m.step(sizes[k])  # warm-up: optimizer state, allocator caches
    if target_s > 0:
        repeats = min(max_repeats, max(repeats, round(target_s / max(warm[first], 1e-3))))
    times: dict[Any, list[float]] = {k: [] for k in models}
    for r in range(repeats):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for k in order:
            times[k].append(models[k].step(sizes[k]))
    return times


def interleaved_times(models: dict[Any, TimedModel], batch_size: int | dict[Any, int], repeats: int, target_s: float = 0.0) -> dict[Any, float]:
    """Median step seconds per plan (see interleaved_samples)."""
    return {k: statistics.median(v) for k, v in interleaved_samples(models, batch_size, repeats, target_s).items()}


# -- results and provenance ------------------------------------------------------------------------
# A result must say which code produced it. Every benchmark run as a script records the commit and whether
# the whole work tree was clean (tracked and untracked files, everything but benchmarks/results/, which
# the runs themselves write). A dirty tree is refused before the run starts unless `--allow-dirty` is on
# the command line (or CKPT_TUNE_BENCH_ALLOW_DIRTY=1, which child processes inherit); the result then
# records the dirty paths and a sha256 of `git diff HEAD` plus the untracked files' contents.
ALLOW_DIRTY_FLAG = "--allow-dirty"
ALLOW_DIRTY_ENV = "CKPT_TUNE_BENCH_ALLOW_DIRTY"
if ALLOW_DIRTY_FLAG in sys.argv[1:]:  # taken off before the script's own argparse sees it
    sys.argv[:] = [a for i, a in enumerate(sys.argv) if i == 0 or a != ALLOW_DIRTY_FLAG]
    os.environ[ALLOW_DIRTY_ENV] = "1"
RESULTS_REL = "benchmarks/results/"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def provenance() -> dict[str, Any]:
    """{"commit", "short", "clean", "dirty_paths", "diff_sha256"} of the whole work tree now.

    `clean`: nothing differs from HEAD outside benchmarks/results/, untracked files included (ignored
    files such as .venv are not part of the tree). `diff_sha256` (dirty trees only) hashes `git diff HEAD`
    and each untracked file's path and bytes: two runs with the same hash ran the same code."""
    import hashlib

    try:
        commit = _git("rev-parse", "HEAD").strip()
        status = _git("status", "--porcelain", "--untracked-files=all", "-z")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "short": "unknown", "clean": False, "dirty_paths": ["(not a git checkout)"], "diff_sha256": None}
    entries = [e for e in status.split("\0") if e]
    dirty, untracked, skip = [], [], False
    for e in entries:
        if skip:  # the source path of a rename
            skip = False
            continue
        code, path = e[:2], e[3:]
        skip = code[0] in "RC"
        if path.startswith(RESULTS_REL):
            continue
        dirty.append(path)
        if code == "??":
            untracked.append(path)
    diff_hash = None
    if dirty:
        h = hashlib.sha256()
        h.update(subprocess.run(["git", "diff", "HEAD", "--binary", "--", ".", f":(exclude){RESULTS_REL}"], cwd=ROOT,
                                capture_output=True, check=False).stdout)
        for path in sorted(untracked):
            h.update(path.encode() + b"\0")
            with contextlib.suppress(OSError):
                h.update((ROOT / path).read_bytes())
        diff_hash = h.hexdigest()
    return {"commit": commit, "short": commit[:7], "clean": not dirty, "dirty_paths": dirty, "diff_sha256": diff_hash}


def _describe(prov: dict[str, Any]) -> str:
    if prov["clean"]:
        return f"{prov['short']} (clean tree)"
    shown = ", ".join(prov["dirty_paths"][:8]) + (f" and {len(prov['dirty_paths']) - 8} more" if len(prov["dirty_paths"]) > 8 else "")
    return f"{prov['short']} with uncommitted changes to {shown} (--allow-dirty; sha256 of git diff HEAD + untracked: {prov['diff_sha256']})"


def require_clean_tree() -> dict[str, Any]:
    """The tree's provenance at the start of a run; exits 2 on a dirty tree unless --allow-dirty."""
    prov = provenance()
    if not prov["clean"] and os.environ.get(ALLOW_DIRTY_ENV) != "1":
        print(f"refusing to run: the work tree differs from HEAD {prov['short']} ({', '.join(prov['dirty_paths'][:10])}"
              f"{' ...' if len(prov['dirty_paths']) > 10 else ''}). Commit first, or pass {ALLOW_DIRTY_FLAG} "
              "(the result then records the dirty paths and a hash of git diff HEAD).", file=sys.stderr)
        raise SystemExit(2)
    return prov


_main = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
START_PROVENANCE: dict[str, Any] | None = None
if _main is not None and _main.parent == ROOT / "benchmarks" and _main.suffix == ".py":
    START_PROVENANCE = require_clean_tree()  # a benchmark run as a script: refuse a dirty tree up front


def machine() -> dict[str, str]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "uname": " ".join(platform.uname()),
        "nproc": str(os.cpu_count()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": str(torch.get_num_threads()),
        "load_avg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "git": _git_head(),
    }


def _git_head() -> str:
    """The commit and the state of the whole tree, in words (machine()["git"])."""
    return _describe(provenance())


def command() -> str:
    return ".venv/bin/python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]) + (
        f" {ALLOW_DIRTY_FLAG}" if os.environ.get(ALLOW_DIRTY_ENV) == "1" else "")


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_results(name: str, title: str, data: dict[str, Any], body_md: str) -> None:
    """Write results/<name>.json and results/<name>.md with the machine, the command and the provenance:
    the commit and tree state at the start of the run (START_PROVENANCE) and at the end; a run during
    which the code changed says so."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = machine()
    cmd = command()
    end = provenance()
    start = START_PROVENANCE or end
    prov = {**start, "end": None if (end["commit"], end["diff_sha256"]) == (start["commit"], start["diff_sha256"]) else end}
    info["git"] = _describe(start)
    (RESULTS / f"{name}.json").write_text(json.dumps({"benchmark": name, "command": cmd, "machine": info, "provenance": prov, **data},
                                                     indent=2, default=str) + "\n")
    head = [
        f"# {title}",
        "",
        f"- command: `{cmd}`",
        f"- date: {info['date']}",
        f"- machine: `{info['uname']}`, {info['nproc']} CPUs, load average at the end {info['load_avg']}",
        f"- torch {info['torch']}, Python {info['python']}, {info['threads']} torch threads, commit {info['git']}",
    ]
    if prov["end"] is not None:
        head.append(f"- the code changed during the run: at the end {_describe(end)}")
    head += ["", ""]
    (RESULTS / f"{name}.md").write_text("\n".join(head) + body_md.rstrip() + "\n")
    print(f"wrote {RESULTS / (name + '.json')} and .md", file=sys.stderr)


def mib(b: float) -> str:
    return f"{b / MiB:.1f}"


def pct(x: float) -> str:
    s = f"{100 * x:+.2f}%"
    return "0.00%" if s in ("+0.00%", "-0.00%") and x == 0 else s


# -- ckpt-tune's side ---------------------------------------------------------------------------------
def tool_searcher(spec: str, device: str = "cpu", fake_probes: bool = False):
    """A ckpt_tune Searcher on a freshly built target, as `api.search` sets one up (entered runner).
    `fake_probes`: its probes recorded under fake tensors with the CPU allocator's rules, its real steps
    (timing, verification) on the real runner, as `api.search` runs on `--device cpu`."""
    from ckpt_tune.measure import loader, user_code
    from ckpt_tune.measure.runner import StepRunner, StepSettings
    from ckpt_tune.tune.searcher import Searcher

    target = loader.load_target(spec)
    model = user_code.build_model(target).to(device)
    runner = StepRunner(
        model,
        lambda b: user_code.make_batch(target, b, device),
        lambda m, batch: user_code.compute_loss(target, m, batch),
        StepSettings(device=device),
    )
    runner.__enter__()
    if fake_probes:
        from ckpt_tune.measure.session import fake_twin

        fake = fake_twin(target, runner.settings)
        fake.__enter__()
        return Searcher(fake, segments=True, real=runner)
    return Searcher(runner, segments=True)


def block_sizes(ex: Example, units: Sequence[str], batch_size: int) -> tuple[list[int], list[int]]:
    """Per unit: bytes it saves for backward when run normally, and its input bytes (one forward).

    What a user would read off a profiler; measured here with saved-tensor hooks, storages counted once,
    parameters excluded, each saved tensor charged to the innermost running unit."""
    model = ex.build()
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = [0] * len(units)
    inputs = [0] * len(units)
    seen: set[int] = set()
    stack: list[int] = []
    handles = []

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                yield from tensors(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                yield from tensors(o)

    for i, u in enumerate(units):
        mod = model.get_submodule(u)

        def pre(m, args, kwargs, i=i):
            stack.append(i)
            inputs[i] = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors((args, kwargs))}.values())

        def post(m, args, kwargs, out):
            stack.pop()

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if stack and ptr not in params and ptr not in seen:
            seen.add(ptr)
            saved[stack[-1]] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ex.loss_fn(model, ex.make_batch(batch_size))
    del loss
    for h in handles:
        h.remove()
    return saved, inputs
