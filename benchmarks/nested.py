"""Blocks inside stages: the batch `search` reaches against checkpointing every innermost block.

For each model of tests/nested_models.py (a ResNet with residual blocks in Sequential stages, a
ConvNeXt-style model whose stages downsample before their blocks, a U-Net with nested encoder and
decoder stages, a transformer whose MLP routes tokens to experts) the budget is set halfway between what
checkpointing every innermost block (the hand-written list) measures at batch 12 and at batch 13, so
that plan fits batch 12 and no more. Then `search` runs on that budget, in a fresh process per
checkout: this one, and, with `--before PATH`, an earlier checkout of ckpt-tune side by side. Every
peak here is the independent harness's (tests/harness.py), never ckpt-tune's own.

    python benchmarks/nested.py [--before /path/to/older/checkout] [--batch 12]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import md_table, mib, write_results  # noqa: E402
from tests.harness import measured_peak  # noqa: E402
from tests.nested_models import TARGETS  # noqa: E402

# Run in a child process with the checkout under test first on sys.path.
CHILD = """
import json, sys, time, importlib.util
root, models, name, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("nested_models", models)
mod = importlib.util.module_from_spec(spec); sys.modules["nested_models"] = mod; spec.loader.exec_module(mod)
from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.tune.searcher import Searcher
t = mod.TARGETS[name]
t0 = time.perf_counter()
with StepRunner(t.build(), t.make_batch, t.loss_fn) as runner:
    res = Searcher(runner, segments=True).search(budget)
plan = [list(getattr(e, "modules", (e,) if isinstance(e, str) else e)) for e in res.checkpoint]
print(json.dumps({"batch": res.batch_size, "plan": plan, "units": list(res.units), "verified": res.verified_peak,
                  "probes": res.probes, "seconds": round(time.perf_counter() - t0, 1)}))
"""


def run_search(root: Path, name: str, budget: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(ROOT / "tests" / "nested_models.py"), name, str(budget)],
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="an earlier checkout of ckpt-tune to compare with")
    ap.add_argument("--batch", type=int, default=12)
    args = ap.parse_args()
    checkouts = [("now", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    rows, data = [], []
    for name, t in TARGETS.items():
        lo = measured_peak(t.build, t.make_batch, t.loss_fn, args.batch, t.innermost)
        hi = measured_peak(t.build, t.make_batch, t.loss_fn, args.batch + 1, t.innermost)
        budget = (lo + hi) // 2
        entry = {"model": name, "innermost": list(t.innermost), "budget": budget, "every_innermost_batch": args.batch,
                 "every_innermost_peak": lo, "every_innermost_peak_next": hi}
        for label, root in checkouts:
            res = run_search(root, name, budget)
            if "plan" in res:
                res["harness_peak"] = measured_peak(t.build, t.make_batch, t.loss_fn, res["batch"], [tuple(p) for p in res["plan"]])
                res["within_budget"] = res["harness_peak"] <= budget
            entry[label] = res
            rows.append([
                name, label, args.batch, res.get("batch", "error"), len(res.get("units", [])),
                mib(res["harness_peak"]) if "harness_peak" in res else "-", mib(budget),
                "yes" if res.get("within_budget") else "no", res.get("seconds", "-"),
                res.get("error") or ", ".join("+".join(p) for p in res["plan"]),
            ])
        data.append(entry)
        print(json.dumps(entry), file=sys.stderr)
    body = (
        "Budget: halfway between what checkpointing every innermost block measures at batch "
        f"{args.batch} and at batch {args.batch + 1} (independent harness). `search` must reach at least batch "
        f"{args.batch} with a plan that measures within the budget.\n\n"
        + md_table(["model", "checkout", "every innermost", "search batch", "units", "plan peak (MiB)", "budget (MiB)",
                    "within", "seconds", "plan"], rows)
    )
    write_results("nested", "Nested blocks: search against every innermost block", {"models": data, "checkouts": {k: str(v) for k, v in checkouts}}, body)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s", file=sys.stderr)
