"""The conformance zoo as a table: every member of tests/zoo/members.py through the four checks of
tests/zoo/checks.py, against the independent harness (tests/harness.py).

Per member: ckpt-tune profile's peak against the harness (bytes and %); the step recorded under fake
tensors with the CPU allocator's rules (what `--device cpu` records for a step larger than the machine)
against the CPU allocator (% or the limitation it stops with), and, reported beside it, how far
`--device meta` (which sizes a CUDA step: foreach AdamW, 512 B blocks, no CPU kernel scratch) is from it; search's batch against the largest batch at which every
innermost block checkpointed fits the same budget; whether the plan search reports measures within the
budget; whether plans change nothing but memory (gradients bit-identical, buffers and RNG state equal);
wall time. A check that raises is a failing row with its error, never a dropped one.

    .venv/bin/python benchmarks/zoo.py                 # all members -> results/zoo.json, zoo.md
    .venv/bin/python benchmarks/zoo.py tv_resnet18 hf_t5   # some (prints, writes nothing)
    --cli: profile and search through the `ckpt-tune ... --json` command (a fresh process each)

Fake mode runs in a fresh process per member (and `--device meta` as the command), so fake-mode state
cannot leak from one model to the next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import md_table, write_results
from tests.zoo import checks
from tests.zoo.members import MEMBERS, Member

FAKE_CPU = (
    "import sys; from tests.zoo import checks; from tests.zoo.members import MEMBERS; "
    "print(checks.fake_peak(MEMBERS[sys.argv[1]], 'cpu'))"
)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def run_member(m: Member, via_cli: bool) -> dict:
    t0 = time.perf_counter()
    row: dict = {"member": m.name, "family": m.family, "target": m.spec, "innermost_blocks": len(m.blocks),
                 "profile_batch": m.profile_batch, "budget_batch": m.budget_batch}
    truth = checks.truth(m.name, m.profile_batch)
    row["harness_peak"] = truth

    # 1. profile
    try:
        got = checks.profiled_peak(m, via_cli=via_cli)
        row["profile_peak"] = got
        row["profile_error_bytes"] = got - truth
        row["profile_ok"] = got == truth
    except Exception as e:
        row["profile_error"], row["profile_ok"] = _first_line(e), False

    # 2. fake mode with the CPU allocator's rules, in a fresh process; then `--device meta` (the command),
    # which sizes a CUDA step: its difference from the CPU allocator is reported, not checked
    f = subprocess.run([sys.executable, "-c", FAKE_CPU, m.name], cwd=checks.ROOT, capture_output=True, text=True, check=False)
    if f.returncode == 0:
        fake = int(f.stdout.strip().splitlines()[-1])
        row["meta_peak"], row["meta_error"] = fake, (fake - truth) / truth
        row["meta_ok"] = m.meta_limitation is None and abs(row["meta_error"]) <= checks.META_TOLERANCE
    p = checks.cli("profile", m.spec, "--device", "meta", "--batch-size", str(m.profile_batch), "--json")
    lines = checks.error_lines(p.stderr)
    if p.returncode == 0:
        row["cuda_meta_peak"] = json.loads(p.stdout)["peak_bytes"]
        row["cuda_meta_vs_cpu"] = (row["cuda_meta_peak"] - truth) / truth
    else:
        row["meta_exit"] = p.returncode
        row["meta_message"] = lines[0] if lines else p.stderr.strip().splitlines()[-1:]
        clean = p.returncode == 1 and "Traceback" not in p.stderr and len(lines) == 1 and "fake tensors" in lines[0]
        row["meta_clean_refusal"] = clean
        row["meta_traceback_on_stderr"] = "Traceback" in p.stderr
        row["meta_ok"] = m.meta_limitation is not None and clean
        row["meta_limitation"] = m.meta_limitation

    # 3. search
    try:
        out = checks.searched(m.name, via_cli=via_cli)
        row.update(budget=out.budget, search_batch=out.batch_size, grad_accum_steps=out.grad_accum_steps,
                   plan=[list(e) if isinstance(e, tuple) else e for e in out.checkpoint],
                   search_verified_peak=out.verified_peak, search_candidates=out.candidates,
                   search_s=round(out.seconds, 1))
        measured = checks.truth(m.name, out.batch_size, out.checkpoint)
        row["plan_measured_peak"] = measured
        row["within_budget"] = measured <= out.budget and out.grad_accum_steps == 1
        row["every_block_batch"] = checks.every_block_batch(m, out.budget)
        row["search_ok"] = row["within_budget"] and out.batch_size >= row["every_block_batch"]
    except Exception as e:
        row["search_error"], row["search_ok"] = _first_line(e), False
        try:
            row["budget"] = checks.budget(m)
            row["every_block_batch"] = checks.every_block_batch(m, row["budget"])
        except Exception as e2:
            row["budget_error"] = _first_line(e2)

    # 4. invariants: the hand-written every-innermost-block plan, and search's plan
    inv = {}
    plans = {"every innermost block": m.blocks}
    if "plan" in row:
        plans["search's plan"] = row["plan"]
    for label, plan in plans.items():
        try:
            inv[label] = checks.invariant_differences(m, plan)
        except Exception as e:
            inv[label] = [_first_line(e)]
    row["invariant_differences"] = inv
    row["invariants_ok"] = all(not d for d in inv.values()) and "plan" in row
    row["ok"] = all(row.get(k) for k in ("profile_ok", "meta_ok", "search_ok", "invariants_ok"))
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def _yes(ok) -> str:
    return "yes" if ok else "**no**"


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "profile_peak" in r:
            prof = "0 B (exact)" if r["profile_error_bytes"] == 0 else f"**{r['profile_error_bytes']:+,} B ({r['profile_error_bytes'] / r['harness_peak']:+.3%})**"
        else:
            prof = f"**{r['profile_error']}**"
        cuda = f"{r['cuda_meta_vs_cpu']:+.2%}" if "cuda_meta_vs_cpu" in r else "-"
        if "meta_error" in r and "meta_exit" not in r:
            meta = f"{r['meta_error']:+.3%}" if r["meta_ok"] else f"**{r['meta_error']:+.3%}**"
        else:
            msg = str(r["meta_message"])[:140].replace("|", "/")
            meta = (f"limitation ({r['meta_limitation']}): exit {r['meta_exit']}, " if r.get("meta_limitation") else
                    f"**exit {r['meta_exit']}**: ") + f"`{msg}`" + (" + traceback logged on stderr" if r["meta_traceback_on_stderr"] else "")
            if not r["meta_ok"]:
                meta = f"**{meta}**" if not meta.startswith("**") else meta
        if "search_batch" in r:
            batch = f"{r['search_batch']} vs {r['every_block_batch']}"
            if r["search_batch"] < r["every_block_batch"]:
                batch = f"**{batch}**"
            fits = _yes(r["within_budget"]) + f" ({r['plan_measured_peak']:,} ≤ {r['budget']:,} B)" if r["within_budget"] else \
                f"**no** ({r['plan_measured_peak']:,} > {r['budget']:,} B)"
        else:
            batch = f"**search failed: {r['search_error'][:160]}** (every block: {r.get('every_block_batch', '?')})"
            fits = "-"
        inv = "; ".join(f"{k}: {'same' if not d else '**' + d[0][:100] + '**'}" for k, d in r["invariant_differences"].items())
        out.append([r["member"], prof, meta, cuda, batch, fits, inv, f"{r['wall_s']:.0f} s", _yes(r["ok"])])
    return md_table(["member", "profile vs harness", "fake tensors (CPU rules) vs CPU allocator", "--device meta (a CUDA step) vs CPU",
                     "search batch vs every-innermost-block batch",
                     "plan ≤ budget", "invariants", "wall", "all pass"], out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("members", nargs="*", help="member names (default: all; a subset writes no results)")
    ap.add_argument("--cli", action="store_true", help="profile and search through the ckpt-tune command")
    ap.add_argument("--from-log", type=Path, help="write the results from the JSON rows a run printed on stderr "
                    "(a run stopped before its end): members without a row are listed as not run")
    args = ap.parse_args()
    names = args.members or list(MEMBERS)
    rows = []
    t0 = time.perf_counter()
    if args.from_log:
        rows = [json.loads(ln) for ln in args.from_log.read_text().splitlines() if ln.startswith('{"member"')]
        missing = [n for n in names if n not in {r["member"] for r in rows}]
        body = table([r for r in rows if "harness_error" not in r])
        body += (f"\n\nPartial run: {len(rows)} of {len(names)} members measured before the run was stopped; "
                 f"not run: {', '.join(missing) or 'none'}. "
                 f"{sum(1 for r in rows if r['ok'])} of {len(rows)} measured members pass all four checks. Bold marks a failing check. "
                 "Budget: the harness-measured peak of every innermost block checkpointed at the member's budget batch, "
                 f"plus {checks.BUDGET_MARGIN:.0%}. Profile and meta at batch 2. Ground truth: tests/harness.py.\n")
        print(body)
        write_results("zoo", "Conformance zoo: third-party models through ckpt-tune's checks (partial run)",
                      {"rows": rows, "not_run": missing, "partial": True, "meta_tolerance": checks.META_TOLERANCE,
                       "budget_margin": checks.BUDGET_MARGIN}, body)
        return
    for name in names:
        try:
            row = run_member(MEMBERS[name], args.cli)
        except Exception as e:  # the harness itself failed: still a row
            traceback.print_exc()
            row = {"member": name, "ok": False, "harness_error": _first_line(e)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("search_candidates",)}, default=str), file=sys.stderr, flush=True)
    total = time.perf_counter() - t0
    body = table([r for r in rows if "harness_error" not in r])
    broken = [r for r in rows if "harness_error" in r]
    if broken:
        body += "\n\nHarness failures: " + "; ".join(f"{r['member']}: {r['harness_error']}" for r in broken)
    passing = sum(1 for r in rows if r["ok"])
    body += (f"\n\n{passing} of {len(rows)} members pass all four checks; {total:.0f} s in all. Bold marks a failing check. "
             "Budget: the harness-measured peak of every innermost block (the hand-written list in the member's file) "
             f"checkpointed at the member's budget batch, plus {checks.BUDGET_MARGIN:.0%}. Profile and meta at the member's "
             "profile batch (2). The --device meta column is not a check: a CUDA step differs from a CPU one by "
             "design (foreach optimizer temporaries, 512 B allocator blocks, no oneDNN scratch or LSTM workspace). Ground truth: tests/harness.py (fresh model, its own checkpoint wrappers, CPU allocator events).\n")
    print(body)
    if not args.members:
        write_results("zoo", "Conformance zoo: third-party models through ckpt-tune's checks",
                      {"rows": rows, "total_s": round(total, 1), "via": "cli" if args.cli else "api",
                       "meta_tolerance": checks.META_TOLERANCE, "budget_margin": checks.BUDGET_MARGIN}, body)


if __name__ == "__main__":
    main()
