"""Fake mode against the independent harness on the conformance zoo.

Fake mode (`ckpt_tune.measure.fake`: a fake-tensor step recorded with the CPU allocator's rules, what
`--device cpu` records for a step larger than the machine; `tests/zoo/checks.py` `fake_peak(m, "cpu")`)
is judged here by `tests/harness.measured_peak` alone: a freshly built real model, the CPU allocator's
`[memory]` events read by torch.profiler, no ckpt-tune code. Not by fake mode's own recorder.

Per member of tests/zoo/members.py, at its profile batch: the harness's peak, fake mode's peak (in a
fresh process per member, so no fake-mode state leaks between models), the difference in bytes and %.
`--device meta` (which sizes a CUDA step and differs from the CPU by design) is not judged here; see
results/zoo.md.

    .venv/bin/python benchmarks/fake_accuracy.py [--members tv_vit,hf_bert] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, md_table, write_results
from tests.zoo import checks
from tests.zoo.members import MEMBERS

FAKE_CPU = (
    "import sys; from tests.zoo import checks; from tests.zoo.members import MEMBERS; "
    "print(checks.fake_peak(MEMBERS[sys.argv[1]], 'cpu'))"
)


def run_member(name: str) -> dict:
    m = MEMBERS[name]
    t0 = time.perf_counter()
    truth = checks.truth(name, m.profile_batch)
    t_h = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", FAKE_CPU, name], cwd=ROOT, capture_output=True, text=True, check=False)
    t_f = time.perf_counter() - t0
    row = {"member": name, "family": m.family, "batch": m.profile_batch, "harness_bytes": truth,
           "harness_s": t_h, "fake_s": t_f}
    if p.returncode == 0:
        fake = int(p.stdout.strip().splitlines()[-1])
        row.update(fake_bytes=fake, diff_bytes=fake - truth, error=(fake - truth) / truth)
    else:
        row.update(fake_bytes=None, error=None, failure=(p.stderr.strip().splitlines() or ["?"])[-1][:300])
    return row


def fmt_pct(x: float, digits: int = 3) -> str:
    s = f"{100 * x:+.{digits}f}%"
    return s if x != 0 else f"{0:.{digits}f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default=",".join(MEMBERS), help="comma-separated zoo members (default: all)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for name in args.members.split(","):
        r = run_member(name)
        rows.append(r)
        err = "FAILED " + r["failure"] if r["error"] is None else fmt_pct(r["error"])
        print(f"{name:24} harness {r['harness_bytes']:>13,} B  fake {r['fake_bytes'] or 0:>13,} B  {err}", flush=True)
    ok = [r for r in rows if r["error"] is not None]
    errs = [abs(r["error"]) for r in ok]
    summary = {
        "members": len(rows), "ran": len(ok), "exact": sum(1 for r in ok if r["diff_bytes"] == 0),
        "median_abs_error": statistics.median(errs) if errs else None, "max_abs_error": max(errs) if errs else None,
        "max_abs_diff_bytes": max((abs(r["diff_bytes"]) for r in ok), default=None),
        "within_1pct": sum(1 for e in errs if e <= checks.META_TOLERANCE),
        "elapsed_s": time.perf_counter() - t0,
    }
    worst = max(ok, key=lambda r: abs(r["error"])) if ok else None
    lines = [
        "Fake mode with the CPU allocator's rules (`tests/zoo/checks.py` `fake_peak(m, \"cpu\")`, a fresh process per "
        "member) against the independent harness (`tests/harness.measured_peak`: a real model, the CPU allocator's "
        "events from torch.profiler, no ckpt-tune code), one training iteration at each member's profile batch, "
        "fp32, AdamW. Error = (fake - harness) / harness.",
        "",
        "## Summary",
        "",
        md_table(["members", "ran under fake tensors", "exact to the byte", "within 1%", "median abs. error", "max abs. error",
                  "largest difference"],
                 [[summary["members"], summary["ran"], summary["exact"], summary["within_1pct"],
                   f"{100 * summary['median_abs_error']:.3f}%" if errs else "-",
                   f"{100 * summary['max_abs_error']:.3f}%" if errs else "-",
                   f"{summary['max_abs_diff_bytes']:,} B" if errs else "-"]]),
        "",
    ]
    if worst is not None:
        lines += [f"Largest error: {worst['member']}, {fmt_pct(worst['error'])} ({worst['diff_bytes']:+,} B). "
                  f"Ran in {summary['elapsed_s']:.0f} s.", ""]
    lines += [
        "## Per member",
        "",
        md_table(["member", "family", "batch", "harness B", "fake mode B", "fake - harness", "error"],
                 [[r["member"], r["family"], r["batch"], f"{r['harness_bytes']:,}",
                   f"{r['fake_bytes']:,}" if r["fake_bytes"] is not None else "failed: " + r["failure"],
                   f"{r['diff_bytes']:+,} B" if r["error"] is not None else "-",
                   fmt_pct(r["error"]) if r["error"] is not None else "-"] for r in rows]),
    ]
    body = "\n".join(lines)
    print(body)
    write_results("fake_accuracy", "Fake mode against the independent harness (conformance zoo)",
                  {"summary": summary, "rows": rows}, body)


if __name__ == "__main__":
    main()
