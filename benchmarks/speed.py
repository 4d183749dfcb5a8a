"""Speed: wall time and peak RSS of `ckpt-tune profile` and `ckpt-tune search`, each case a fresh process.

Each case runs the real command line (`ckpt_tune.cli.main`) in a child Python process that reports its
own `resource.getrusage(RUSAGE_SELF).ru_maxrss` and the wall time from before `import ckpt_tune` to the
end (interpreter start-up excluded; the parent's total, start-up included, is recorded too). Cases:
the examples on CPU, and, where `--device meta` (fake tensors, ckpt_tune/fake.py) runs, Llama-2
7B/13B/70B from `examples/configs/` built from their configs without weights. Meta cases run under an
address-space limit (`--meta-limit`, default 4 GiB) so that a build that materialises real weights fails
fast instead of exhausting the machine's memory; such a case is reported as pending with its error.

    .venv/bin/python benchmarks/speed.py [--only profile,search] [--skip-meta]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXAMPLE_CASES = [
    ("profile", "gpt", ["examples/gpt.py:build", "--device", "cpu", "--batch-size", "16"]),
    ("profile", "resnet", ["examples/resnet.py:build", "--device", "cpu", "--batch-size", "32"]),
    ("profile", "unet", ["examples/unet.py:build", "--device", "cpu", "--batch-size", "8"]),
    ("profile", "hf_gpt2", ["examples/hf_gpt2.py:build", "--device", "cpu", "--batch-size", "8"]),
    ("search", "gpt", ["examples/gpt.py:build", "--device", "cpu", "--vram", "200MiB"]),
    ("search", "resnet", ["examples/resnet.py:build", "--device", "cpu", "--vram", "100MiB"]),
    ("search", "unet", ["examples/unet.py:build", "--device", "cpu", "--vram", "60MiB"]),
    ("search", "hf_gpt2", ["examples/hf_gpt2.py:build", "--device", "cpu", "--vram", "250MiB"]),
]
META_CASES = [
    (cmd, name, ["--hf-config", f"examples/configs/{name}.json", "--device", "meta", "--seq-len", "512", "--precision", "bf16", *extra])
    for name in ("llama-2-7b", "llama-2-13b", "llama-2-70b")
    for cmd, extra in (("profile", ["--batch-size", "1"]), ("search", ["--vram", "80GiB"]))
]

CHILD = """
import json, os, resource, sys, time
t0 = time.perf_counter()
limit = int(os.environ.get("BENCH_AS_LIMIT", "0"))
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["ckpt-tune", *json.loads(os.environ["BENCH_ARGV"])]
rc = 0
try:
    from ckpt_tune.cli import main
    main()
except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
except BaseException as e:
    rc = 99
    sys.stderr.write(f"{type(e).__name__}: {e}\\n")
wall = time.perf_counter() - t0
with open(os.environ["BENCH_REPORT"], "w") as f:
    json.dump({"rc": rc, "wall_s": wall, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}, f)
"""


def run_case(cmd: str, name: str, args: list[str], as_limit: int = 0, threads: int = 1) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as rep:
        report = rep.name
    env = {**os.environ, "BENCH_ARGV": json.dumps([cmd, *args, "--json"]), "BENCH_REPORT": report,
           "BENCH_AS_LIMIT": str(as_limit), "TORCH_CPP_LOG_LEVEL": "ERROR", "COLUMNS": "400",
           "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True)
    total = time.perf_counter() - t0
    try:
        child = json.loads(Path(report).read_text())
    except (OSError, json.JSONDecodeError):
        child = {"rc": p.returncode, "wall_s": None, "maxrss_kib": None}
    Path(report).unlink(missing_ok=True)
    row = {"command": cmd, "case": name, "argv": ["ckpt-tune", cmd, *args], "rc": child["rc"], "wall_s": child["wall_s"],
           "process_wall_s": total, "peak_rss_mib": child["maxrss_kib"] / 1024 if child["maxrss_kib"] else None}
    if child["rc"] in (0, 3):
        try:
            out = json.loads(p.stdout)
        except json.JSONDecodeError:
            out = {}
        if cmd == "search" and "plan" in out:
            row["batch_size"] = out["plan"]["batch_size"]
            row["checkpointed"] = sum(1 if isinstance(e, str) else len(e) for e in out["plan"]["checkpoint"])
            row["segments"] = sum(1 for e in out["plan"]["checkpoint"] if not isinstance(e, str))
            row["recorded_steps"] = out.get("recorded_steps")
        if cmd == "profile":
            row["peak_bytes"] = out.get("peak_bytes")
    else:
        err = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("USDT")]
        row["error"] = " / ".join(err[-3:])[:400]
    if child["rc"] == 3:  # the answer is "no": say why, in the tool's words
        lines = [ln.strip() for ln in p.stderr.splitlines()]
        start = next((i for i, ln in enumerate(lines) if ln.startswith("error:")), None)
        msg = []
        for ln in lines[start:] if start is not None else []:
            if ln.startswith("hint:") or not ln:
                break
            msg.append(ln)
        row["answer"] = " ".join(msg)[len("error:"):].strip() if msg else "nothing fits"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="profile,search", help="commands to run")
    ap.add_argument("--skip-meta", action="store_true", help="leave out the Llama --device meta cases")
    ap.add_argument("--meta-limit", default=4, type=float, help="address-space limit (GiB) of a meta case")
    ap.add_argument("--threads", default=1, type=int,
                    help="OMP_NUM_THREADS of each case (on this 2-vCPU machine 1 thread ran the GPT profile 2.6x faster than 2)")
    args = ap.parse_args()
    import torch

    from benchmarks.common import md_table, write_results

    torch.set_num_threads(args.threads)  # this process's own count, as the results header reports it

    wanted = set(args.only.split(","))
    rows = []
    for cmd, name, a in EXAMPLE_CASES:
        if cmd in wanted:
            rows.append(run_case(cmd, name, a, threads=args.threads))
            print(json.dumps(rows[-1]), flush=True)
    meta_state = "skipped (--skip-meta)"
    if not args.skip_meta:
        meta_state = "ran"
        for cmd, name, a in META_CASES:
            if cmd in wanted:
                rows.append(run_case(cmd, name, a, as_limit=int(args.meta_limit * (1 << 30)), threads=args.threads))
                print(json.dumps(rows[-1]), flush=True)
                if rows[-1]["rc"] not in (0, 3):  # 3 is an answer ("nothing fits"); larger configs would fail alike
                    meta_state = (f"pending: `ckpt-tune {cmd} --hf-config examples/configs/{name}.json --device meta` "
                                  "does not run yet (its error below); the larger configs were not attempted")
                    break

    def cell(r):
        if r["rc"] == 3:
            return f"exit 3 (nothing fits): {r.get('answer', '')}"
        if r["rc"] != 0:
            return f"fails (exit {r['rc']}): {r.get('error', '')}"
        if r["command"] == "search":
            segs = f" in {r['segments']} segment{'s' if r['segments'] > 1 else ''}" if r.get("segments") else ""
            return f"batch {r.get('batch_size')}, {r.get('checkpointed')} blocks checkpointed{segs}, {r.get('recorded_steps')} recorded steps"
        return f"peak {r['peak_bytes'] / (1 << 20):.1f} MiB" if r.get("peak_bytes") else ""

    table = md_table(
        ["command", "case", "wall time", "with interpreter start", "peak RSS", "result"],
        [[r["command"], f"`{' '.join(r['argv'][2:])}`", f"{r['wall_s']:.1f} s" if r["wall_s"] is not None else "-",
          f"{r['process_wall_s']:.1f} s", f"{r['peak_rss_mib']:.0f} MiB" if r["peak_rss_mib"] else "-", cell(r)] for r in rows],
    )
    body = "\n\n".join([
        "Each case is a fresh process running the command line with `--json`; wall time from before `import "
        f"ckpt_tune` to exit, peak RSS from `getrusage(RUSAGE_SELF)` in that process; OMP_NUM_THREADS={args.threads}. "
        f"Meta cases: {meta_state}.",
        table,
    ])
    print(table)
    write_results("speed", "Speed: profile and search wall time and peak RSS", {"meta": meta_state, "rows": rows}, body)


if __name__ == "__main__":
    main()
