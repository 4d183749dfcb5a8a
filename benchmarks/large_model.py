"""Planning 7B/70B Hugging Face models under fake tensors: wall time, max RSS, recorded steps, exit code
and plan, for this checkout and, side by side in the same run, for the same checkout in one process
(CKPT_TUNE_WORKERS=1: no probe shared out over forked processes) and recording every step at full depth
(identical blocks not shortened), or for an earlier commit (issue 14).

    python benchmarks/large_model.py [--before full-depth | --before <commit>] [--only 7b] [--no-one-process] [--also <commit>] [--repeat 3]

This checkout's default run (and the --also commit's) runs `--repeat` times, the two in turn; a row
gives the run of median wall time and every run's wall time: on a shared machine the same command's
time moves by a third from one minute to the next. Each command runs in a fresh child process whose checkout comes first on sys.path; the child reports
its own peak RSS and the largest of the processes it forked (getrusage) at exit. The rule: where both
checkouts find a plan, this checkout's is the same batch with the same or a lower predicted recompute;
where the earlier one exits 3 (nothing fits), so does this one; the one-process run finds the same plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402

COMMANDS = {
    "7b": ["--hf-config", "examples/configs/llama-2-7b.json", "--seq-len", "4096", "--device", "meta",
           "--precision", "bf16-mixed", "--vram", "80GB"],
    "7b-zero3-x8": ["--hf-config", "examples/configs/llama-2-7b.json", "--seq-len", "4096", "--device", "meta",
                    "--precision", "bf16-mixed", "--vram", "80GB", "--world-size", "8", "--shard", "zero3"],
    "70b-zero3-x64": ["--hf-config", "examples/configs/llama-2-70b.json", "--seq-len", "4096", "--device", "meta",
                      "--precision", "bf16-mixed", "--vram", "80GB", "--world-size", "64", "--shard", "zero3"],
}

CHILD = """
import atexit, resource, sys
sys.path.insert(0, {root!r})
atexit.register(lambda: print("BENCH_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                              resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr))
sys.argv = ["ckpt-tune", "search", *{args!r}, "--json"]
if {full_depth!r}:  # every probe at full depth: no run of identical blocks is shortened
    import importlib
    for name in ("ckpt_tune.tune.searcher", "ckpt_tune.tune.probing"):  # an earlier checkout has no probing
        try:
            importlib.import_module(name).find_repeat = lambda model, units: None
        except ModuleNotFoundError:
            pass
import ckpt_tune.cli as cli
getattr(cli, "entry", cli.main)()  # the installed program's entry point (an earlier checkout has only main)
"""
FULL_DEPTH = "full-depth"


def run(checkout: Path, args: list[str], timeout: int, full_depth: bool = False, workers: str | None = None) -> dict:
    """One command in a fresh process; `workers`: CKPT_TUNE_WORKERS for it (None: the tool's default)."""
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "CKPT_TUNE_WORKERS"}
    if workers is not None:
        env["CKPT_TUNE_WORKERS"] = workers
    try:
        child = CHILD.format(root=str(checkout), args=args, full_depth=full_depth)
        p = subprocess.run([sys.executable, "-c", child], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "wall_s": round(time.perf_counter() - t0, 1), "error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t0
    rss = [line.split()[1:] for line in p.stderr.splitlines() if line.startswith("BENCH_RSS_KIB")]
    out: dict = {"exit_code": p.returncode, "wall_s": round(wall, 1), "max_rss_mib": round(int(rss[-1][0]) / 1024) if rss else None,
                 # the largest forked probe process (0: none was forked)
                 "forked_max_rss_mib": round(int(rss[-1][1]) / 1024) if rss else None}
    try:
        data = json.loads(p.stdout)
    except json.JSONDecodeError:
        err = [line for line in p.stderr.splitlines() if line.startswith("error:") or "nothing fits" in line]
        out["error"] = (err[0] if err else p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "")[:400]
        return out
    plan = data["plan"]
    out.update(
        recorded_steps=data.get("recorded_steps"),
        stage_seconds=data.get("stage_seconds"),
        extended_terms=len(data.get("extended_terms") or {}),
        batch_size=plan["batch_size"],
        checkpoint=plan["checkpoint"],
        predicted_recompute_fraction=plan["predicted_recompute_fraction"],
        predicted_peak_bytes=plan["predicted_peak_bytes"],
        verified_peak_bytes=plan["verified_peak_bytes"],
        sharding=plan.get("sharding", "none" if plan.get("world_size", 1) == 1 else "arithmetic"),
    )
    return out


def median_run(runs: list[dict]) -> dict:
    """The run of median wall time, with every run's wall time (`walls_s`) and whether all found the same
    plan (`same_plan_every_run`)."""
    ranked = sorted(runs, key=lambda r: r["wall_s"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    keys = ("exit_code", "batch_size", "checkpoint", "predicted_peak_bytes", "verified_peak_bytes")
    out.update(walls_s=[r["wall_s"] for r in runs], same_plan_every_run=len({json.dumps([r.get(k) for k in keys]) for r in runs}) == 1)
    return out


def _wall(x: dict) -> str:
    walls = x.get("walls_s") or []
    if len(walls) < 2:
        return str(x.get("wall_s"))
    same = "" if x.get("same_plan_every_run", True) else "; PLANS DIFFER between runs"
    return f"{x.get('wall_s')} (median of {', '.join(str(w) for w in walls)}{same})"


def verdict(before: dict, after: dict) -> str:
    if before.get("exit_code") is None:
        return "before timed out"
    if before["exit_code"] != after["exit_code"]:
        return "DIFFERENT exit codes"
    if "batch_size" not in before:
        return "same exit code (no plan)"
    if after["batch_size"] > before["batch_size"]:
        return "larger batch"
    if after["batch_size"] < before["batch_size"]:
        return "SMALLER batch"
    if after["checkpoint"] == before["checkpoint"]:
        return "equal plan"
    if after["predicted_recompute_fraction"] <= before["predicted_recompute_fraction"]:
        return "same batch, cheaper or equal recompute"
    return "MORE EXPENSIVE plan"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=FULL_DEPTH,
                    help=f"{FULL_DEPTH} (this checkout, no shortened chain) or a commit, e.g. 4a75528 (before issue 14's work)")
    ap.add_argument("--only", nargs="*", default=list(COMMANDS))
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of results/large_model.json that --only does not name, run the others")
    ap.add_argument("--no-before", action="store_true", help="run this checkout only (rows say 'not compared')")
    ap.add_argument("--no-one-process", action="store_true", help="leave out the run of this checkout in one process")
    ap.add_argument("--also", metavar="COMMIT", help="also run each command at this commit (an earlier checkout's "
                    "times side by side: no verdict)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of this checkout's default command (and of --also's), "
                    "one after the other in turn; the row is the run of median wall time, with every wall time")
    a = ap.parse_args()
    tree = Path("/tmp/i14/before")
    if not a.no_before and a.before != FULL_DEPTH and not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), a.before], cwd=ROOT, check=True, capture_output=True)
    also_tree = Path(f"/tmp/i14/also-{a.also}")
    if a.also and not also_tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(also_tree), a.also], cwd=ROOT, check=True, capture_output=True)
    rows: dict = {}
    saved = ROOT / "benchmarks" / "results" / "large_model.json"
    if a.resume and saved.exists():
        rows = {k: v for k, v in json.loads(saved.read_text())["rows"].items() if k not in a.only}
    for name in a.only:
        args = COMMANDS[name]
        afters, alsos = [], []
        for _ in range(a.repeat):  # in turn: a slower minute of the machine falls on both checkouts
            afters.append(run(ROOT, args, a.timeout))
            print(name, "after", afters[-1], file=sys.stderr, flush=True)
            if a.also:
                alsos.append(run(also_tree, args, a.timeout))
                print(name, a.also, alsos[-1], file=sys.stderr, flush=True)
        after = median_run(afters)
        one = {} if a.no_one_process else run(ROOT, args, a.timeout, workers="1")
        if one:
            print(name, "one process", one, file=sys.stderr, flush=True)
        if a.no_before:
            rows[name] = {"args": args, "before": {}, "after": after, "verdict": "not compared (--no-before)"}
        else:
            before = run(ROOT, args, a.timeout, full_depth=True) if a.before == FULL_DEPTH else run(tree, args, a.timeout)
            print(name, "before", before, file=sys.stderr, flush=True)
            rows[name] = {"args": args, "before": before, "after": after, "verdict": verdict(before, after)}
        if one:
            rows[name].update(one_process=one, one_process_verdict=verdict(one, after))
        if a.also:
            rows[name].update(also=median_run(alsos), also_commit=a.also)
        report(rows, a.before)  # after every command: a long run keeps what it measured
    report(rows, a.before)


def _gib(x: dict, key: str) -> str:
    return f"{x[key] / 2**30:.2f}" if x.get(key) is not None else "-"


def report(rows: dict, before_commit: str) -> None:
    a_before = before_commit
    compared = any(r["before"] for r in rows.values())
    lines = [
        f"Rule: where both find a plan, this checkout's is the same batch with the same or lower predicted "
        f"recompute (or a larger batch); where {a_before} exits 3, so does this checkout."
        + (" `full-depth` is this checkout with every recorded step at full depth (no run of identical blocks "
           "shortened; the benchmark's child process disables `find_repeat`)." if a_before == FULL_DEPTH else "")
        if compared else "This checkout only (--no-before): no rule applies.",
        "",
        "| command | checkout | exit | wall s | max RSS MiB (this / largest forked) | recorded steps | batch | checkpoints | recompute | "
        "predicted / verified GiB per GPU | sharding | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"before": a_before, "after": "this (shortened)" if a_before == FULL_DEPTH else "this",
             "one_process": "this, one process"}
    for name, r in rows.items():
        for label in ("after", "one_process", "before", "also"):
            x = r.get(label)
            if not x:
                continue
            names["also"] = f"{r.get('also_commit')} (earlier checkout)"
            say = r["verdict"] if label == "after" else r.get("one_process_verdict", "") if label == "one_process" else ""
            lines.append(
                f"| {name} | {names[label]} | {x.get('exit_code')} | {_wall(x)} | "
                f"{x.get('max_rss_mib')} / {x.get('forked_max_rss_mib', '-')} | {x.get('recorded_steps', '-')} | {x.get('batch_size', '-')} | "
                f"{len(x['checkpoint']) if 'checkpoint' in x else '-'} | {x.get('predicted_recompute_fraction', '-')} | "
                f"{_gib(x, 'predicted_peak_bytes')} / {_gib(x, 'verified_peak_bytes')} | {x.get('sharding', '-')} | {say} |"
            )
    for name, r in rows.items():
        if "error" in r["after"] and "error" in r.get("before", {}):
            same = "identical" if r["after"]["error"] == r["before"]["error"] else "DIFFERENT"
            lines += ["", f"{name}: error messages {same}: `{r['after']['error'][:200]}`"]
    if any(r.get("also") for r in rows.values()):
        lines += ["", "The earlier checkout's rows are that commit's code run the same way in the same run (times side by "
                  "side; its plans are not judged)."]
    lines += ["", "Verdict of the one-process row: against the default run (the same plan expected). Timings: compare "
              "the runs of one command, made one after the other on the machine above; the default run shares probe "
              "steps and frontier solves out over forked processes, one per core (CKPT_TUNE_WORKERS), and the "
              "largest forked process's RSS is the second RSS figure (0: none was forked)."]
    lines += ["", "Commands: `ckpt-tune search <args> --json`, with:", ""]
    lines += [f"- {name}: `{' '.join(r['args'])}`" for name, r in rows.items()]
    lines += ["", "Stage seconds (this checkout): " + "; ".join(f"{n}: {r['after'].get('stage_seconds')}" for n, r in rows.items())]
    write_results("large_model", "Planning large models under fake tensors (issue 14)", {"before_commit": a_before, "rows": rows},
                  "\n".join(lines))


if __name__ == "__main__":
    main()
