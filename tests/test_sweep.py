"""The sweep's stratified subset: ckpt-tune on fast representatives of every library and kind of
benchmarks/sweep.py (transformers causal/masked LMs, seq2seq, image classification and speech seq2seq;
torchvision classification and segmentation; timm families; the diffusers models), each through the sweep's
three checks against the independent harness (tests/harness.py):

1. `ckpt_tune.profile` at batch 2 equals the harness's peak to the byte;
2. the default search under budget = static + 3 × (peak(2) − static) returns a plan whose verified peak and
   whose harness-measured peak (the harness's own wrappers) are within the budget, at a batch no smaller than
   every innermost block checkpointed reaches;
3. `ckpt_tune.apply(fresh model, plan)` gives the same loss, gradients, buffers and RNG state as the plain step.

The architectures run two at a time (one torch thread each), each in a forked process with a timeout, once
per module; each test asserts its architecture's row. The whole sweep is `benchmarks/sweep.py`
(`make sweep`); `benchmarks/sweep.py --subset` runs these and prints the table.
"""

from __future__ import annotations

import pytest

from benchmarks import sweep

pytestmark = [
    pytest.mark.slow,
    # third-party deprecation warnings (transformers, timm, diffusers) are not what the checks look at; the
    # forked runs ignore them too (sweep_models.quiet)
    pytest.mark.filterwarnings("ignore"),
]

TIMEOUT = 150  # seconds per architecture (each takes 5-25 CPU seconds)


def _param(key: str):
    marks = [pytest.mark.hf] if key.startswith("transformers:") else []
    return pytest.param(key, id=key, marks=marks)


@pytest.fixture(scope="module")
def rows(request) -> dict[str, dict]:
    """The rows of the architectures selected in this module, run two at a time."""
    keys = [item.callspec.params["key"] for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec") and "key" in item.callspec.params]
    archs = sweep.select(None, False, None, list(dict.fromkeys(keys)))
    out = sweep.run_many(archs, jobs=2, timeout=TIMEOUT, exact=False, log=lambda line: None)
    return {f"{r['library']}:{r['architecture']}": r for r in out}


def explain(row: dict) -> str:
    lines = [f"{row['library']}:{row['architecture']}: {row.get('failure_class')}"]
    for f in row.get("failures", []):
        lines.append(f"  [{f.get('class')}] {f.get('error')}" + (f" (at {f['where']})" if f.get("where") else ""))
    figures = ("predicted_bytes", "measured_bytes", "budget_bytes", "batch", "every_block_batch",
               "verified_peak_bytes", "measured_peak_bytes", "checkpoint")
    lines.append("  " + ", ".join(f"{k}={row.get(k)}" for k in figures if k in row))
    return "\n".join(lines)


def test_subset_is_stratified():
    """At least 40 architectures, from all four libraries and every kind the sweep covers."""
    keys = sweep.SUBSET
    assert len(set(keys)) == len(keys) >= 40
    libraries = {k.partition(":")[0] for k in keys}
    assert libraries == {"transformers", "torchvision", "timm", "diffusers"}
    from benchmarks import sweep_models as sm

    kinds = {(a.library, a.kind) for a in sweep.select(None, False, None, list(keys))}
    want = {("transformers", k) for k in sm.HF_MAPPINGS} | {("torchvision", "classification"),
                                                            ("torchvision", "segmentation")}
    assert want <= kinds, f"kinds missing from the subset: {sorted(want - kinds)}"


@pytest.mark.parametrize("key", [_param(k) for k in sweep.SUBSET])
def test_architecture(rows: dict[str, dict], key: str):
    row = rows[key]
    assert not row.get("skipped"), f"{key} no longer builds: {row['skipped']}"
    assert row["passed"], explain(row)
