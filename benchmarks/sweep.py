"""The sweep: ckpt-tune on every architecture of transformers, torchvision, timm and diffusers
(benchmarks/sweep_models.py), three checks each against the independent harness (tests/harness.py).

1. profile: `ckpt_tune.profile` at batch 2 on the CPU equals the harness's peak of the same step, to the byte.
   Every harness peak is of the step in which every layer runs (`every_layer`: Hugging Face's LayerDrop off),
   the worst case of the random stream, which is what ckpt-tune measures.
2. search: the default search (`ckpt_tune.search`, as `ckpt-tune search --device cpu` runs it: segments on,
   every kind of candidate) under budget = static + 3 × (peak(2) − static), static being the parameters,
   buffers, gradients and AdamW's two moments (at most peak(2): a parameter without a gradient has neither). It passes when it returns a plan whose verified peak is within
   the budget, whose peak as the harness measures it (the plan's entries wrapped by the harness's own
   checkpoint wrappers) at its batch is within the budget, and whose batch is at least the every-block batch:
   the largest batch at which the harness's step with every innermost block (`find_blocks`) checkpointed fits
   (with no blocks, the largest batch without checkpointing).
3. correctness: one step (batch 2) of a fresh model with `ckpt_tune.apply(model, plan)` against one without,
   both seeded alike (dropout on): the same loss, gradients, buffers (BatchNorm statistics and their counters)
   and global RNG state afterwards; bit for bit, or within 1e-6 relative where the plain step is itself not
   reproducible bit for bit (`tests.harness.one_step`).

An architecture that does not build from the generic tiny config, or whose plain step raises with the generic
inputs, is recorded as skipped (counted in the table, excluded from the pass rate). A failing check gets a
`failure_class` derived from where and how it failed (`classify`); errors also record whether they came as a
raw traceback rather than a CkptTuneError (`raw_traceback`), and whether the message says "the training step
raised" although the harness ran the plain step fine (`blames_user`).

Each architecture runs in a forked process with a timeout (a hang or a crash ends that row only).

    .venv/bin/python benchmarks/sweep.py [--allow-dirty]    # all -> results/sweep.json, sweep.md
    .venv/bin/python benchmarks/sweep.py --only timm --limit 5 --jobs 2   # some (prints, writes nothing)
    .venv/bin/python benchmarks/sweep.py --subset          # the stratified subset of tests/test_sweep.py
    .venv/bin/python benchmarks/sweep.py --render          # results/sweep.md again from sweep.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import sweep_models as sm
from benchmarks.common import RESULTS, md_table, write_results

SPEC = "benchmarks/sweep_models.py:build"
PROFILE_BATCH = 2
BUDGET_FACTOR = 3  # budget = static + BUDGET_FACTOR × (peak(PROFILE_BATCH) − static)
MAX_BATCH = 4096
DEFAULT_TIMEOUT = 240
TOLERANCE = 1e-6  # relative, where the plain step itself is not reproducible bit for bit
CHECKS = ("build", "profile", "search", "plan", "every-block", "correctness")

# The stratified subset (tests/test_sweep.py): fast representatives of every library and kind, about 420 CPU
# seconds in all (3.5 min on 2 idle cores; the sweep's rows give each one's `cpu_seconds`).
SUBSET = (
    # transformers causal LMs: dense, GQA, ALiBi, sliding window, MoE, latent attention
    "transformers:LlamaForCausalLM", "transformers:GPT2LMHeadModel", "transformers:Qwen2ForCausalLM",
    "transformers:MistralForCausalLM", "transformers:OPTForCausalLM", "transformers:GPTNeoXForCausalLM",
    "transformers:BloomForCausalLM", "transformers:Gemma2ForCausalLM", "transformers:MixtralForCausalLM",
    "transformers:DeepseekV3ForCausalLM", "transformers:PhiForCausalLM", "transformers:FalconForCausalLM",
    "transformers:ArceeForCausalLM", "transformers:Apertus1p5TextForCausalLM",
    # masked LMs, seq2seq, image classification, speech seq2seq
    "transformers:BertForMaskedLM", "transformers:RobertaForMaskedLM", "transformers:AlbertForMaskedLM",
    "transformers:DebertaV2ForMaskedLM", "transformers:ElectraForMaskedLM",
    "transformers:T5ForConditionalGeneration", "transformers:BartForConditionalGeneration",
    "transformers:MT5ForConditionalGeneration",
    "transformers:ViTForImageClassification", "transformers:ResNetForImageClassification",
    "transformers:ConvNextForImageClassification", "transformers:WhisperForConditionalGeneration",
    # torchvision: classification and segmentation
    "torchvision:squeezenet1_1", "torchvision:squeezenet1_0", "torchvision:mnasnet0_5", "torchvision:efficientnet_b0",
    "torchvision:googlenet", "torchvision:shufflenet_v2_x0_5", "torchvision:lraspp_mobilenet_v3_large",
    # timm: one per family
    "timm:test_efficientnet", "timm:lcnet_035", "timm:mobilenetv2_035", "timm:ese_vovnet19b_slim_dw",
    "timm:cs3darknet_focus_s",
    # diffusers
    "diffusers:UNet2DModel", "diffusers:DiTTransformer2DModel", "diffusers:AutoencoderKL",
)


# -- the harness's side ----------------------------------------------------------------------------------
def _harness():
    from tests import harness

    return harness


def static_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, plus a gradient and AdamW's two moments per trainable parameter."""
    seen: dict[int, int] = {}
    trainable = 0
    for p in model.parameters():
        ptr = p.untyped_storage().data_ptr()
        if ptr not in seen:
            seen[ptr] = p.untyped_storage().nbytes()
            if p.requires_grad:
                trainable += p.numel() * p.element_size()
    for b in model.buffers():
        seen.setdefault(b.untyped_storage().data_ptr(), b.untyped_storage().nbytes())
    return sum(seen.values()) + 3 * trainable


def largest_fitting(peak_at, limit: int, start: int, exact: bool = True) -> tuple[int, dict[int, int | None]]:
    """Largest batch b ≥ 0 with peak_at(b) ≤ limit (peaks grow with the batch; a step that raises does not
    fit), searched from `start` by a line through two measurements, then walked to the boundary. Without
    `exact`, when `start + 1` does not fit it returns `start` at once, meaning "at most start"."""
    seen: dict[int, int | None] = {}

    def peak(b: int) -> int | None:
        if b not in seen:
            try:
                seen[b] = peak_at(b)
            except Exception:  # (a step that raises at b does not fit)
                seen[b] = None
        return seen[b]

    def fits(b: int) -> bool:
        return b == 0 or (peak(b) is not None and peak(b) <= limit)

    start = max(1, start)
    if not exact and not fits(start + 1):
        return start, seen  # at most `start`: all a comparison with `start` needs
    guess = start
    if peak(start) is not None and peak(start + 1) is not None and peak(start + 1) > peak(start):
        guess = start + (limit - peak(start)) // (peak(start + 1) - peak(start))  # a line through two batches
        guess = int(min(max(guess, 1), MAX_BATCH))
    step = 1
    if fits(guess):  # lo fits, hi does not
        lo, hi = guess, None
        while hi is None:
            nxt = min(lo + step, MAX_BATCH + 1)
            if nxt <= MAX_BATCH and fits(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
    else:
        lo, hi = None, guess
        while lo is None:
            nxt = max(hi - step, 0)
            if fits(nxt):
                lo = nxt
            else:
                hi, step = nxt, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, seen


# -- errors and their classes ----------------------------------------------------------------------------
def _short(path: str) -> str:
    path = path.replace("\\", "/")
    for mark in ("site-packages/", "/ckpt_tune/"):
        if mark in path:
            return ("ckpt_tune/" if mark == "/ckpt_tune/" else "") + path.split(mark, 1)[1]
    return path.rsplit("/", 2)[-1] if "/" in path else path


def _where(exc: BaseException) -> tuple[str, str]:
    """(deepest frame in ckpt_tune, deepest frame anywhere) where the exception started: in the traceback
    of the exception it was raised from (the root of the chain), else its own."""
    root = _root(exc)
    ours = ""
    for e in (root, exc):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/ckpt_tune/" in f.filename.replace("\\", "/")]
        if frames:
            ours = f"{_short(frames[-1].filename)}:{frames[-1].name}"
            break
    tb = traceback.extract_tb(root.__traceback__) or traceback.extract_tb(exc.__traceback__)
    anywhere = f"{_short(tb[-1].filename)}:{tb[-1].name}" if tb else ""
    return ours, anywhere


def _root(exc: BaseException) -> BaseException:
    e = exc
    for _ in range(8):
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None:
            break
        e = nxt
    return e


def first_line(text: str) -> str:
    s = str(text).strip()
    return s.splitlines()[0][:400] if s else ""


def error_record(stage: str, exc: BaseException) -> dict[str, Any]:
    from ckpt_tune.errors import CkptTuneError

    root = _root(exc)
    ours, anywhere = _where(exc)
    return {
        "check": stage,
        "error_type": type(exc).__name__,
        "error": first_line(exc),
        "cause_type": type(root).__name__ if root is not exc else None,
        "cause": first_line(root) if root is not exc else None,
        "where_ckpt_tune": ours,
        "where": anywhere,
        "raw_traceback": not isinstance(exc, CkptTuneError),
        "traceback": "".join(traceback.format_exception(exc))[-2500:],
    }


# message patterns -> a name for what went wrong (checked against the error and its cause)
PATTERNS = (
    (r"modified by an inplace operation", "in-place op on a saved tensor"),
    (r"backward through the graph a second time", "graph freed before a second backward"),
    (r"Recomputed values for the following tensors have different metadata|different number of tensors was saved",
     "recompute differs from the forward"),
    (r"op polic", "op-policy timing"),
    (r"out of memory|can't allocate memory", "out of memory"),
)


def _pattern(*texts: str | None) -> str | None:
    for rx, name in PATTERNS:
        if any(t and re.search(rx, t) for t in texts):
            return name
    return None


def _limitation(error: str) -> str:
    """What a LimitationError says failed, in a few words (the innermost exception type it names)."""
    inner = re.findall(r"\b([A-Z]\w*(?:Error|Exception)):", error)
    return inner[-1] if inner else first_line(error)[:60]


def classify(fail: dict[str, Any], harness_ok: bool = True) -> str:
    """The failure class of one failed check (a record of `error_record`, or a check that measured wrong)."""
    check = fail["check"]
    if fail.get("class"):
        return fail["class"]
    if check in ("timeout", "crash"):
        return fail["error"]
    if check == "build":
        return sm.DOES_NOT_BUILD
    error = fail.get("error") or ""
    if check in ("plan", "every-block"):
        return f"harness cannot run the plan ({fail['error_type']})" if check == "plan" else "harness: every-block step raised"
    stage = {"profile": "profile", "search": "search", "correctness": "apply"}.get(check, check)
    what = _pattern(error, fail.get("cause"))
    if check == "correctness" and fail.get("raw_traceback"):  # the step of the model with the plan applied
        return f"applied plan's step raised {fail['error_type']}" + (f" ({what})" if what else "")
    if fail.get("raw_traceback"):
        where = fail.get("where_ckpt_tune") or fail.get("where") or "?"
        module = where.split(":")[0].removeprefix("ckpt_tune/").removesuffix(".py")
        return f"{stage}: internal {fail['error_type']}" + (f" ({what})" if what else f" in {module}")
    if fail["error_type"] == "NoFitError":
        return f"{stage}: no fit"
    if fail["error_type"] == "LimitationError":
        return f"{stage}: ckpt-tune limitation ({what or _limitation(error)})"
    if "the training step raised" in error and harness_ok:
        inner = re.match(r"the training step raised (\w+)", error)
        return f"{stage}: user-step error blamed ({what or (inner.group(1) if inner else '?')})"
    if fail["error_type"] == "UserCodeError":
        return f"{stage}: user-code error ({what or first_line(error)[:60]})"
    return f"{stage}: {fail['error_type']}" + (f" ({what})" if what else "")


# -- one architecture ------------------------------------------------------------------------------------
def run_arch(arch: sm.Arch, exact: bool = False, progress=None) -> dict[str, Any]:
    """The three checks of one architecture, in this process; the row of the results.

    `progress(row)` is called after each stage (the forked runner saves it: a timeout keeps what was done).
    `exact`: the every-block batch exactly, not only as "≤ the plan's batch" where it is no larger."""
    import ckpt_tune
    from ckpt_tune.plan.entry import plain
    from ckpt_tune.tune.candidates import find_blocks

    harness = _harness()
    sm.quiet()
    t_start = time.perf_counter()
    row: dict[str, Any] = {
        "library": arch.library, "architecture": arch.name, "kind": arch.kind, "detail": arch.detail,
        "passed": None, "failure_class": None, "skipped": None, "failures": [],
        "raw_traceback": False, "blames_user": False, "stage": "build", "stage_seconds": {},
    }
    save = progress or (lambda r: None)
    stage_t = [time.perf_counter()]

    cpu_start = time.process_time()

    def stage(name: str) -> None:
        now = time.perf_counter()
        row["stage_seconds"][row["stage"]] = round(now - stage_t[0], 2)
        row["stage"], stage_t[0] = name, now
        row["seconds"] = round(now - t_start, 2)
        row["cpu_seconds"] = round(time.process_time() - cpu_start, 2)  # all of its threads
        save(row)

    def fail(check: str, exc: BaseException | None = None, cls: str | None = None, **info) -> None:
        rec = error_record(check, exc) if exc is not None else {"check": check, "error": info.pop("error", cls)}
        rec.update(info)
        if check in ("plan", "every-block"):  # the harness's own run, not ckpt-tune's
            rec["raw_traceback"] = False
        if cls:
            rec["class"] = cls
        rec["blames_user"] = bool("the training step raised" in (rec.get("error") or "") and harness_ok)
        rec["class"] = classify(rec, harness_ok)
        row["failures"].append(rec)
        row["raw_traceback"] |= bool(rec.get("raw_traceback"))
        row["blames_user"] |= rec["blames_user"]

    # 0. build, and the harness's plain step at batch 2 (the first variant that runs it)
    peaks: dict[str, Any] = {}
    harness_ok = False

    def plain_step(r: sm.Recipe) -> None:
        model = r.build()
        row["params"] = sm.n_params(model)
        if row["params"] > sm.MAX_PARAMS:
            raise sm.TooLarge(f"{row['params'] / 1e6:.0f}M parameters > {sm.MAX_PARAMS / 1e6:.0f}M")
        row["static_bytes"] = static_bytes(model)
        row["use_cache"] = _uses_cache(model)
        row["blocks"] = len(blocks := tuple(find_blocks(model)))
        peaks["blocks"] = blocks
        del model
        peaks["plain"] = harness.measured_peak(r.build, r.make_batch, r.loss_fn, PROFILE_BATCH, wrap=every_layer)

    try:
        variant, rec, why = sm.first_working_variant(arch, plain_step)
    except Exception as e:
        row.update(skipped=first_line(e), passed=None)
        stage("done")
        return row
    harness_ok = True
    os.environ[sm.ENV] = sm.selection(arch.key, variant)
    build, make_batch, loss_fn = rec.build, rec.make_batch, rec.loss_fn
    row.update(variant=variant, recipe=rec.describe, variants_failed=why, measured_bytes=peaks["plain"])
    settings = ckpt_tune.Settings(device="cpu")

    # 1. profile
    stage("profile")
    try:
        prof = ckpt_tune.profile(SPEC, batch_size=PROFILE_BATCH, settings=settings, scaling=False)
        row["predicted_bytes"] = prof.peak_bytes
        if prof.peak_bytes != peaks["plain"]:
            fail("profile", cls="profile mismatch",
                 error=f"profile {prof.peak_bytes:,} B vs harness {peaks['plain']:,} B ({prof.peak_bytes - peaks['plain']:+,} B)")
    except Exception as e:
        fail("profile", e)

    # 2. search
    stage("search")
    # parameters that get no gradient (an unused tower) have no gradient or AdamW state: static is at most the peak
    static = min(row["static_bytes"], peaks["plain"])
    budget = static + BUDGET_FACTOR * (peaks["plain"] - static)
    row["budget_bytes"] = budget
    plan = None
    try:
        outcome = ckpt_tune.search(SPEC, vram=str(budget), settings=settings)
        plan = outcome.plan
        row.update(batch=plan.batch_size, grad_accum_steps=plan.grad_accum_steps,
                   checkpoint=[e if isinstance(e, str) else list(e) for e in plain(plan.checkpoint)],
                   predicted_peak_bytes=plan.predicted_peak_bytes, verified_peak_bytes=plan.verified_peak_bytes,
                   units=len(outcome.result.units), search_notes=outcome.result.notes[:12])
        every = outcome.result.baselines.get("every block")
        row["tool_every_block_batch"] = getattr(every, "batch_size", None)
        if plan.verified_peak_bytes is None or plan.verified_peak_bytes > budget:
            fail("search", cls="plan over budget (verified)",
                 error=f"verified peak {plan.verified_peak_bytes} B > budget {budget:,} B")
    except Exception as e:
        fail("search", e)

    if plan is not None:
        # the plan measured by the harness, at its batch (its wrappers turn Hugging Face's use_cache off, as
        # checkpointing does)
        stage("plan")
        try:
            peak = harness.measured_peak(build, make_batch, loss_fn, plan.batch_size, checkpoint=plan.checkpoint,
                                         accum_steps=plan.grad_accum_steps, wrap=every_layer)
            row["measured_peak_bytes"] = peak
            if peak > budget:
                fail("plan", cls="plan over budget (measured)",
                     error=f"harness measures the plan at {peak:,} B > budget {budget:,} B (batch {plan.batch_size})")
        except Exception as e:
            fail("plan", e, cls=harness_class(e, plan))

        # the every-innermost-block batch
        stage("every-block")
        try:
            blocks = peaks["blocks"]

            def every_peak(b: int) -> int:
                return harness.measured_peak(build, make_batch, loss_fn, b, checkpoint=blocks, wrap=every_layer)

            eb, seen = largest_fitting(every_peak, budget, plan.batch_size, exact=exact)
            row["every_block_batch"] = eb if exact or eb > plan.batch_size else f"≤{eb}"
            row["every_block_peaks"] = {str(k): v for k, v in sorted(seen.items())}
            if eb > plan.batch_size:
                fail("search", cls="batch below every-block",
                     error=f"search's batch {plan.batch_size} < every-block batch {row['every_block_batch']}")
        except Exception as e:
            fail("every-block", e)

        # 3. correctness
        stage("correctness")
        try:
            diffs, tol = correctness(build, make_batch, loss_fn, plan)
            row["correctness_tolerance"] = tol
            for d in diffs:
                fail("correctness", cls=d[0], error=d[1])
        except Exception as e:
            fail("correctness", e)

    row["passed"] = not row["failures"]
    row["failure_class"] = row["failures"][0]["class"] if row["failures"] else None
    stage("done")
    return row


def _uses_cache(model: torch.nn.Module) -> bool:
    """Whether a (Hugging Face) config of the model or of a submodule has `use_cache` on."""
    return any(getattr(getattr(m, "config", None), "use_cache", None) is True for m in model.modules())


def harness_class(exc: BaseException, plan) -> str:
    """Why the harness's own wrappers could not run the plan. Its `Segment` runs a segment's blocks as a
    chain, x = block(x, *the first block's other arguments), and hands only the last block's output on."""
    segments = any(getattr(e, "is_segment", False) for e in plan.checkpoint)
    if segments and isinstance(exc, (ValueError, AssertionError, TypeError, RuntimeError, IndexError)):
        return "harness cannot run the plan's segment (blocks that are not a chain)"
    return f"harness cannot run the plan ({type(exc).__name__})"


def correctness(build, make_batch, loss_fn, plan) -> tuple[list[tuple[str, str]], str]:
    """(class, message) per difference between a step of a fresh model with the plan applied and one
    without, and the comparison used ("bitwise", or "1e-6 relative" when the plain step is not reproducible)."""
    import ckpt_tune

    one_step = _harness().one_step
    batch = make_batch(PROFILE_BATCH)
    user_loss = loss_fn

    def loss_fn(model, batch):  # numpy's and Python's generators seeded too (SpeechT5's masks use numpy)
        import random

        import numpy as np

        np.random.seed(0)
        random.seed(0)
        return user_loss(model, batch)

    want = one_step(build(), batch, loss_fn)
    wrapped = ckpt_tune.apply(build(), plan)
    got = one_step(wrapped, batch, loss_fn)

    def same(a: torch.Tensor, b: torch.Tensor, tol: bool) -> bool:
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if torch.equal(a, b):
            return True
        if not tol or not a.is_floating_point():
            return False
        scale = b.abs().max().item() if b.numel() else 0.0
        return torch.allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE * scale, equal_nan=True)

    def compare(tol: bool) -> list[tuple[str, str]]:
        out = []
        if not same(got["loss"], want["loss"], tol):
            out.append(("loss differs", f"loss {got['loss'].item()!r} != {want['loss'].item()!r}"))
        if got["grads"].keys() != want["grads"].keys():
            out.append(("gradients differ", f"gradients of different parameters: {sorted(got['grads'].keys() ^ want['grads'].keys())[:4]}"))
        bad = [n for n, g in want["grads"].items() if n in got["grads"] and not same(got["grads"][n], g, tol)]
        if bad:
            n = bad[0]
            out.append(("gradients differ", f"{len(bad)} gradients differ, e.g. {n} by {(got['grads'][n] - want['grads'][n]).abs().max().item():.3g}"))
        bad = [n for n, b in want["buffers"].items() if n not in got["buffers"] or not same(got["buffers"][n], b, tol)]
        if bad:
            out.append(("buffers differ", f"{len(bad)} buffers differ, e.g. {bad[0]}"))
        if not torch.equal(got["rng"], want["rng"]):
            out.append(("RNG state differs", "the global RNG state after the step differs"))
        return out

    diffs = compare(tol=False)
    if not diffs:
        return [], "bitwise"
    again = one_step(build(), batch, loss_fn)  # is the plain step itself reproducible bit for bit?
    reproducible = torch.equal(again["loss"], want["loss"]) and all(
        torch.equal(again["grads"][n], g) for n, g in want["grads"].items() if n in again["grads"])
    if reproducible:
        return diffs, "bitwise"
    return compare(tol=True), f"{TOLERANCE:g} relative (the plain step is not reproducible bit for bit)"


# -- many architectures, one forked process each ------------------------------------------------------------
def _child(arch: sm.Arch, path: str, threads: int, exact: bool) -> None:
    with contextlib.suppress(Exception):  # Linux: end with the sweep, even when it is killed
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    torch.set_num_threads(threads)
    sm.quiet()

    def save(row: dict[str, Any]) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(row, f, default=str)
        os.replace(tmp, path)

    try:
        save(run_arch(arch, exact=exact, progress=save))
    except BaseException as e:
        save({"library": arch.library, "architecture": arch.name, "kind": arch.kind, "passed": False, "stage": "done",
              "failures": [{**error_record("crash", e), "class": f"sweep error ({type(e).__name__})"}]})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_many(archs: list[sm.Arch], jobs: int, timeout: float, exact: bool = False, log=print) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("fork")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    rows: dict[int, dict[str, Any]] = {}
    pending = list(enumerate(archs))
    running: dict[int, tuple[Any, str, float]] = {}
    tmpdir = tempfile.mkdtemp(prefix="ckpt_tune_sweep_")
    t0 = time.perf_counter()
    try:
        _loop(archs, jobs, timeout, exact, log, ctx, threads, rows, pending, running, tmpdir, t0)
    except KeyboardInterrupt:  # stop: the rows done so far, the others marked as not run
        for p, _, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        log(f"interrupted after {len(rows)} of {len(archs)}")
        for i, arch in enumerate(archs):
            rows.setdefault(i, {"library": arch.library, "architecture": arch.name, "kind": arch.kind,
                                "detail": arch.detail, "passed": None, "skipped": "not run (the sweep was interrupted)",
                                "failures": []})
    return [rows[i] for i in range(len(archs))]


def _loop(archs, jobs, timeout, exact, log, ctx, threads, rows, pending, running, tmpdir, t0) -> None:
    while pending or running:
        while pending and len(running) < jobs:
            i, arch = pending.pop(0)
            path = os.path.join(tmpdir, f"{i}.json")
            p = ctx.Process(target=_child, args=(arch, path, threads, exact), daemon=True)
            p.start()
            running[i] = (p, path, time.perf_counter())
        time.sleep(0.2)
        for i, (p, path, started) in list(running.items()):
            arch = archs[i]
            elapsed = time.perf_counter() - started
            if p.exitcode is None and elapsed < timeout:
                continue
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
            partial = _read(path)
            row = partial or {"library": arch.library, "architecture": arch.name, "kind": arch.kind, "failures": []}
            row.setdefault("failures", [])
            where = row.get("stage", "build")
            if where != "done":
                what = "timeout" if p.exitcode is None or elapsed >= timeout else f"crash ({_signal_name(p.exitcode)})"
                if where == "build":  # before any check: the plain step did not finish
                    row["skipped"] = f"{what} before the checks (building and the plain step)"
                else:
                    row["failures"].append({"check": what.split(" ")[0], "class": f"{what} in {where}",
                                            "error": f"{what} after {elapsed:.0f} s, in {where}"})
            if row.get("skipped"):
                row["passed"] = None
            else:
                row["passed"] = not row["failures"]
            row["failure_class"] = row["failures"][0]["class"] if row["failures"] and not row.get("skipped") else None
            row["seconds"] = round(elapsed, 1)
            rows[i] = row
            del running[i]
            status = "skip" if row.get("skipped") else "pass" if row.get("passed") else f"FAIL {row['failure_class']}"
            log(f"[{len(rows)}/{len(archs)} {time.perf_counter() - t0:.0f}s] {arch.key} {elapsed:.1f}s {status}")


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _signal_name(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"exit code {code}"


# -- the tables ------------------------------------------------------------------------------------------
def mib(b: Any) -> str:
    return f"{b / 2**20:.2f}" if isinstance(b, (int, float)) else "–"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"by_library": {}}
    for lib in sm.LIBRARIES:
        mine = [r for r in rows if r["library"] == lib]
        built = [r for r in mine if not r.get("skipped")]
        out["by_library"][lib] = {"architectures": len(mine), "built": len(built),
                                  "passed": sum(1 for r in built if r.get("passed")),
                                  "skipped": len(mine) - len(built)}
    built = [r for r in rows if not r.get("skipped")]
    out["architectures"], out["built"] = len(rows), len(built)
    out["passed"] = sum(1 for r in built if r.get("passed"))
    out["pass_rate"] = round(out["passed"] / len(built), 4) if built else None
    out["failure_classes"] = dict(collections.Counter(r["failure_class"] for r in built if r.get("failure_class")).most_common())
    out["skip_reasons"] = dict(collections.Counter(_skip_kind(r["skipped"]) for r in rows if r.get("skipped")).most_common())
    out["raw_tracebacks"] = sum(1 for r in built if r.get("raw_traceback"))
    out["blames_user"] = sum(1 for r in built if r.get("blames_user"))
    return out


def _skip_kind(reason: str) -> str:
    if "before the checks" in reason or "not run" in reason:
        return reason.split(" (")[0].removesuffix(" before the checks")
    if "too large" in reason and reason.count("#") == 1:
        return f"too large (over {sm.MAX_PARAMS / 1e6:.0f}M parameters)"
    return sm.DOES_NOT_BUILD


def render(rows: list[dict[str, Any]], seconds: float | None = None) -> str:
    s = summary(rows)
    lines = [
        f"{s['built']} of {s['architectures']} architectures build from the generic tiny config and run a plain step; "
        f"**{s['passed']} pass** all checks ({100 * (s['pass_rate'] or 0):.1f}%). "
        f"{s['raw_tracebacks']} end in a raw traceback (not a CkptTuneError); {s['blames_user']} say \"the training "
        "step raised\" although the harness ran the plain step fine.",
        "",
        "Budget = static + 3 × (peak at batch 2 − static); every-block batch = the largest batch at which the harness's "
        "step with every innermost block checkpointed fits that budget. Bytes in MiB.",
        "",
    ]
    if seconds is not None:
        lines += [f"Wall time of the sweep: {seconds / 60:.1f} min.", ""]
    lines += ["## By library", "", md_table(
        ["library", "architectures", "build", "skipped", "pass", "pass rate"],
        [[lib, v["architectures"], v["built"], v["skipped"], v["passed"],
          f"{100 * v['passed'] / v['built']:.0f}%" if v["built"] else "–"] for lib, v in s["by_library"].items()]), ""]
    lines += ["## Failure classes", "", "The first failing check of each architecture that builds.", ""]
    examples = collections.defaultdict(list)
    for r in rows:
        if r.get("failure_class") and not r.get("skipped"):
            examples[r["failure_class"]].append(f"{r['library']}:{r['architecture']}")
    lines += [md_table(["failure class", "count", "examples"],
                       [[c, n, ", ".join(examples[c][:3])] for c, n in s["failure_classes"].items()]), ""]
    lines += ["Skipped (excluded from the pass rate):", "", md_table(["reason", "count"], list(s["skip_reasons"].items())), ""]
    lines += ["## Per architecture", "", md_table(
        ["library", "architecture", "kind", "passed", "failure class", "profile (tool / harness)", "budget", "batch",
         "every-block batch", "verified / measured peak", "s", "first error"],
        [[r["library"], r["architecture"], r.get("kind", ""),
          "skip" if r.get("skipped") else "yes" if r.get("passed") else "**no**",
          r.get("failure_class") or "",
          f"{mib(r.get('predicted_bytes'))} / {mib(r.get('measured_bytes'))}" if not r.get("skipped") else "",
          mib(r.get("budget_bytes")) if not r.get("skipped") else "",
          r.get("batch", ""), r.get("every_block_batch", ""),
          f"{mib(r.get('verified_peak_bytes'))} / {mib(r.get('measured_peak_bytes'))}" if r.get("batch") else "",
          r.get("seconds", ""),
          _cell((r.get("skipped") or "")[len(sm.DOES_NOT_BUILD) + 2:] if r.get("skipped")
                else (r["failures"][0].get("error") or "") if r.get("failures") else "")]
         for r in rows])]
    return "\n".join(lines) + "\n"


def _cell(text: str, n: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= n else text[: n - 1] + "…"


def select(only: str | None, subset: bool, limit: int | None, names: list[str]) -> list[sm.Arch]:
    archs = sm.all_archs(only)
    if subset or names:
        wanted = list(SUBSET) if subset else names
        by_key = {a.key: a for a in archs}
        missing = [k for k in wanted if k not in by_key]
        if missing:
            raise SystemExit(f"not in the enumeration: {', '.join(missing)}")
        archs = [by_key[k] for k in wanted if only in (None, k.partition(':')[0])]
    return archs[:limit] if limit else archs


def every_layer(model) -> None:
    """LayerDrop off (Hugging Face's `layerdrop`, a layer skipped at random in training): the peaks are of
    the step in which every layer runs, the worst case, which is what ckpt-tune measures."""
    for mod in model.modules():
        if isinstance(mod.__dict__.get("layerdrop"), float):
            mod.layerdrop = 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="library:name of the architectures to run (default: all)")
    ap.add_argument("--only", choices=sm.LIBRARIES, help="one library")
    ap.add_argument("--limit", type=int, help="the first N architectures")
    ap.add_argument("--subset", action="store_true", help="the stratified subset of tests/test_sweep.py")
    ap.add_argument("--jobs", type=int, default=1, help="architectures at a time (default 1; torch threads = CPUs / jobs)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per architecture")
    ap.add_argument("--exact", action="store_true",
                    help="the every-block batch exactly (default: exactly only where it beats search's batch, "
                         "else recorded as ≤ search's batch: one or two measurements fewer)")
    ap.add_argument("--list", action="store_true", help="print the architectures and exit")
    ap.add_argument("--render", action="store_true", help="write results/sweep.md again from results/sweep.json")
    ap.add_argument("--update", action="store_true",
                    help="run NAMES again and replace their rows in results/sweep.json (recorded in it), then --render")
    args = ap.parse_args()
    if args.render:
        data = json.loads((RESULTS / "sweep.json").read_text())
        rerender(data)
        return
    sm.quiet()
    archs = select(args.only, args.subset, args.limit, args.names)
    if args.update:
        update(archs, args)
        return
    if args.list:
        print("\n".join(f"{a.key}\t{a.kind}\t{a.detail}" for a in archs))
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill PID` stops it as Ctrl-C does: results kept
    t0 = time.perf_counter()
    order = interleaved(archs)  # the libraries in turn: a sweep stopped early has some of each
    done = {id(a): r for a, r in zip(order, run_many(order, args.jobs, args.timeout, exact=args.exact,
                                                                   log=lambda s: print(s, flush=True)))}
    rows = [done[id(a)] for a in archs]
    seconds = time.perf_counter() - t0
    body = render(rows, seconds)
    whole = not (args.only or args.limit or args.subset or args.names)
    if not whole:
        print(body)
        return
    data = {"settings": {"profile_batch": PROFILE_BATCH, "budget_factor": BUDGET_FACTOR, "jobs": args.jobs,
                         "exact_every_block": args.exact,
                         "timeout_s": args.timeout, "max_params": sm.MAX_PARAMS, "versions": versions()},
            "seconds": round(seconds, 1), "summary": summary(rows), "rows": rows}
    write_results("sweep", "Sweep: ckpt-tune on every architecture of transformers, torchvision, timm and diffusers", data, body)


def update(archs: list[sm.Arch], args) -> None:
    """Run `archs` again and put their rows in results/sweep.json in place of the old ones."""
    from benchmarks.common import command, provenance

    data = json.loads((RESULTS / "sweep.json").read_text())
    new = run_many(archs, args.jobs, args.timeout, exact=args.exact, log=lambda s: print(s, flush=True))
    by_key = {f"{r['library']}:{r['architecture']}": r for r in new}
    data["rows"] = [by_key.pop(f"{r['library']}:{r['architecture']}", r) for r in data["rows"]]
    prov = provenance()
    data.setdefault("updates", []).append({
        "command": command(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": prov["short"], "clean": prov["clean"], "diff_sha256": prov["diff_sha256"],
        "rows": [a.key for a in archs]})
    rerender(data)


def interleaved(archs: list[sm.Arch]) -> list[sm.Arch]:
    by_lib = [[a for a in archs if a.library == lib] for lib in sm.LIBRARIES]
    out = []
    for i in range(max(map(len, by_lib), default=0)):
        out += [lib[i] for lib in by_lib if i < len(lib)]
    return out


def rerender(data: dict[str, Any]) -> None:
    """sweep.md from sweep.json: the classes derived again from the recorded errors, the header as recorded."""
    rows = data["rows"]
    for r in rows:
        if r.get("skipped"):
            continue
        for f in r.get("failures", []):  # the classes derived from an exception (not a measured verdict)
            if f.get("check") in ("profile", "search", "correctness", "every-block") and "error_type" in f:
                f["class"] = classify({**f, "class": None}, True)
        r["failure_class"] = r["failures"][0]["class"] if r.get("failures") else None
    data["summary"] = summary(rows)
    (RESULTS / "sweep.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    info, prov = data["machine"], data.get("provenance", {})
    head = [
        "# Sweep: ckpt-tune on every architecture of transformers, torchvision, timm and diffusers", "",
        f"- command: `{data['command']}`", f"- date: {info['date']}",
        f"- machine: `{info['uname']}`, {info['nproc']} CPUs, load average at the end {info['load_avg']}",
        f"- torch {info['torch']}, Python {info['python']}, {info['threads']} torch threads, commit {info['git']}",
    ]
    if prov.get("end"):
        from benchmarks.common import _describe

        head.append(f"- the code changed during the run: at the end {_describe(prov['end'])}")
    for u in data.get("updates", []):
        head.append(f"- rows run again on {u['date']} at {u['commit']}{'' if u['clean'] else ' (with uncommitted changes)'}: "
                    f"`{u['command']}` ({len(u['rows'])} rows)")
    (RESULTS / "sweep.md").write_text("\n".join([*head, "", ""]) + render(rows, data.get("seconds")))


def versions() -> dict[str, str]:
    out = {}
    for name in ("transformers", "torchvision", "timm", "diffusers"):
        with contextlib.suppress(ImportError):
            out[name] = __import__(name).__version__
    return out


if __name__ == "__main__":
    main()
