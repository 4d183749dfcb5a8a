"""Same plans across revisions: `search --device meta` on the example targets at several budgets, at
earlier revisions (each in a temporary git worktree) and at the working tree, side by side.

Under `--device meta` the step is recorded under fake tensors and FLOPs stand for time: nothing depends
on timing noise, so the same search code gives the same plan, batch and peaks to the byte. A row that
differs is a change in what the search answers (the table says which field); a revision that cannot run a
case (a kind of choice it did not have yet) says so.

    .venv/bin/python benchmarks/same_plans.py                  # against REFERENCES -> results/same_plans.json, .md
    .venv/bin/python benchmarks/same_plans.py --before HEAD~1 --cases gpt_1g   # prints, writes nothing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, md_table, write_results

# (name, target, --vram, --candidates): --device meta holds back 768 MiB of CUDA context and a margin, so
# these leave some 100 MiB to 2 GiB for the step; offload where a revision has it
CASES = [
    ("gpt_900m", "examples/gpt.py:build", "900MiB", "all"),
    ("gpt_1g", "examples/gpt.py:build", "1GiB", "all"),
    ("gpt_1.5g", "examples/gpt.py:build", "1.5GiB", "all"),
    ("gpt_1g_blocks", "examples/gpt.py:build", "1GiB", "blocks,segments"),
    ("gpt_1g_offload", "examples/gpt.py:build", "1GiB", "all,offload"),
    ("resnet_1g", "examples/resnet.py:build", "1GiB", "all"),
    ("resnet_1.5g", "examples/resnet.py:build", "1.5GiB", "all"),
    ("unet_1g", "examples/unet.py:build", "1GiB", "all"),
    ("unet_1.5g", "examples/unet.py:build", "1.5GiB", "all"),
    ("vit_1g", "examples/vit.py:build", "1GiB", "all"),
    ("vit_1.5g", "examples/vit.py:build", "1.5GiB", "all,offload"),
    ("hf_gpt2_1.5g", "examples/hf_gpt2.py:build", "1.5GiB", "all"),
    ("hf_gpt2_3g", "examples/hf_gpt2.py:build", "3GiB", "all"),
]
# 884e396: the last revision before the search was split into parts and the kinds of choice registered;
# 9f462e0: the first with offload (the cases that offer it are compared with it)
REFERENCES = ("884e396", "9f462e0")
FIELDS = ("batch_size", "checkpoint", "predicted_peak_bytes", "verified_peak_bytes", "predicted_recompute_fraction")


def run_case(tree: Path, target: str, vram: str, candidates: str) -> dict:
    cmd = [sys.executable, "-m", "ckpt_tune", "search", target, "--device", "meta", "--vram", vram,
           "--candidates", candidates, "--json"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    row = {"exit": p.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    if p.returncode != 0:
        lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
        row["error"] = lines[-1][:200] if lines else f"exit {p.returncode}"
        return row
    out = json.loads(p.stdout)
    plan = out.get("plan", out)
    row.update({f: plan.get(f) for f in FIELDS})
    return row


@contextlib.contextmanager
def worktree(rev: str):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False, capture_output=True)


def compare(rows: dict[str, dict], names: list[str]) -> str:
    now = rows["working tree"]
    for rev in names:
        then = rows[rev]
        if "error" in then or "error" in now:
            return "not run at " + rev if "error" in then and "error" not in now else "failed now" if "error" in now else "both failed"
        differ = [f for f in FIELDS if then.get(f) != now.get(f)]
        if differ:
            return f"differs from {rev}: " + ", ".join(differ)
    return "same"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", nargs="+", default=list(REFERENCES), help="revisions to compare the working tree with")
    ap.add_argument("--cases", nargs="*", choices=[c[0] for c in CASES], default=[c[0] for c in CASES])
    args = ap.parse_args()
    cases = [c for c in CASES if c[0] in args.cases]
    revs = {rev: subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
            for rev in args.before}
    results: dict[str, dict[str, dict]] = {name: {} for name, *_ in cases}
    for rev, short in revs.items():
        with worktree(rev) as tree:
            for name, target, vram, candidates in cases:
                results[name][short] = run_case(tree, target, vram, candidates)
                print(name, short, results[name][short], file=sys.stderr)
    for name, target, vram, candidates in cases:
        results[name]["working tree"] = run_case(ROOT, target, vram, candidates)
        print(name, "now", results[name]["working tree"], file=sys.stderr)
    rows, verdicts = [], {}
    for name, target, vram, candidates in cases:
        # each case against the earliest revision that ran it
        ran = [s for s in revs.values() if "error" not in results[name][s]]
        verdicts[name] = compare(results[name], ran[:1] or list(revs.values())[:1])
        now = results[name]["working tree"]
        rows.append([name, f"`{target}`", vram, candidates, now.get("batch_size", "-"),
                     now.get("verified_peak_bytes", now.get("error", "-")), verdicts[name]])
    same = sum(v == "same" for v in verdicts.values())
    body = [
        f"`search --device meta` (fake tensors, FLOPs for time: no timing noise) on {len(cases)} cases, at "
        + ", ".join(f"{s} ({r})" for r, s in revs.items()) + " and at the working tree. A case is compared with "
        "the earliest of those revisions that ran it; fields compared: " + ", ".join(FIELDS) + ".",
        "",
        f"**{same} of {len(cases)} cases give the same answer to the byte.**",
        "",
        md_table(["case", "target", "--vram", "--candidates", "batch", "verified peak (bytes)", "against the earlier revision"], rows),
    ]
    print("\n".join(body))
    if args.cases == [c[0] for c in CASES] and args.before == list(REFERENCES):
        write_results("same_plans", "Same plans across revisions (search --device meta)",
                      {"revisions": revs, "fields": FIELDS, "cases": {n: {"target": t, "vram": v, "candidates": c} for n, t, v, c in cases},
                       "results": results, "verdicts": verdicts, "same": same, "total": len(cases)}, "\n".join(body))


if __name__ == "__main__":
    main()
