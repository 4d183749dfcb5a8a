"""LoRA and QLoRA plans for Llama models on common GPUs: what `ckpt-tune search --peft qlora|lora` finds
under fake tensors (`--device meta`, CUDA allocator rules, nothing allocated) for Llama-2-7B/13B/70B and
Llama-3-8B, GPU budgets of 12/16/24/48/80 GB and sequence lengths 2048 and 4096; plus a check of small
QLoRA models on the CPU, the tool's prediction against the independent harness (tests/harness.py).

    python benchmarks/qlora.py [--quick] [--models 7b 8b] [--only-seq 2048] [--methods qlora] [--no-cpu-check] [--timeout 900]

Each cell is one `ckpt-tune search ... --json` in a fresh child process (the installed entry point,
`ckpt_tune.cli.entry`), with a timeout; the child reports its own peak RSS and the largest of the probe
processes it forks (getrusage at exit). Budgets run from the largest to the smallest for each (model,
method, seq) and stop at the first exit 3 (nothing fits): a smaller budget cannot fit either, and is
recorded as implied, not run. Results are rewritten after every cell: a partial run leaves an honest
file that lists the cells not run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import md_table, write_results  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
MODELS = {  # name: (label, config); the run's order within a sequence length
    "7b": ("Llama-2-7B", "examples/configs/llama-2-7b.json"),
    "8b": ("Llama-3-8B", "examples/configs/llama-3-8b.json"),
    "13b": ("Llama-2-13B", "examples/configs/llama-2-13b.json"),
    "70b": ("Llama-2-70B", "examples/configs/llama-2-70b.json"),
}
METHODS = ("qlora", "lora")
BUDGETS_GB = (80, 48, 24, 16, 12)  # largest first: the first exit 3 ends the column
SEQS = (2048, 4096)
COMMON = ["--device", "meta", "--precision", "bf16-mixed"]

TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}

CHILD = """
import atexit, resource, sys
sys.path.insert(0, {root!r})
atexit.register(lambda: print("BENCH_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                              resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr))
sys.argv = ["ckpt-tune", "search", *{args!r}, "--json"]
import ckpt_tune.cli as cli
cli.entry()
"""


def n_layers(config: str) -> int:
    return json.loads((ROOT / config).read_text())["num_hidden_layers"]


def cell_key(model: str, method: str, seq: int, gb: int) -> str:
    return f"{model}/{method}/{seq}/{gb}GB"


def cell_args(model: str, method: str, seq: int, gb: int) -> list[str]:
    return ["--hf-config", MODELS[model][1], "--seq-len", str(seq), *COMMON, "--peft", method, "--vram", f"{gb}GB"]


def _first_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("BENCH_RSS_KIB", "BENCH_TIME", "Command exited with", "Command terminated by"))]
    for ln in lines:
        if ln.startswith("error:") or "nothing fits" in ln:
            return ln[:400]
    tb = [ln for ln in lines if ln.startswith("Traceback")]
    if tb:
        return (tb[0] + " ... " + lines[-1])[:400]
    said = [ln.strip(" │|") for ln in lines if "rror" in ln]
    return (said[0] if said else lines[-1] if lines else "")[:400]


def run_search(args: list[str], timeout: int) -> dict:
    """One `ckpt-tune search <args> --json` in a fresh child process: exit code, wall s, peak RSS, the JSON."""
    t0 = time.perf_counter()
    try:
        # under /usr/bin/time: a child forked straight from this process would start from this process's RSS
        # (Linux records the parent's mm high-water mark at exec), so a small program forks it instead
        # in a session of its own: on a timeout the whole group (time, ckpt-tune, its probe processes) is killed
        proc = subprocess.Popen(["/usr/bin/time", "-f", "BENCH_TIME %e %M", sys.executable, "-c", CHILD.format(root=str(ROOT), args=args)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        p = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "exit_code": None, "wall_s": round(time.perf_counter() - t0, 1),
                "error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t0
    rss = [ln.split()[1:] for ln in p.stderr.splitlines() if ln.startswith("BENCH_RSS_KIB")]
    out: dict = {"status": "run", "exit_code": p.returncode, "wall_s": round(wall, 1),
                 "max_rss_mib": round(int(rss[-1][0]) / 1024) if rss else None,
                 "forked_max_rss_mib": round(int(rss[-1][1]) / 1024) if rss else None}
    tm = [ln.split()[1:] for ln in p.stderr.splitlines() if ln.startswith("BENCH_TIME")]
    if tm:  # /usr/bin/time's wall s and max RSS (the process and the children it waited for)
        out.update(time_wall_s=float(tm[-1][0]), time_max_rss_mib=round(int(tm[-1][1]) / 1024))
    try:
        data = json.loads(p.stdout)
    except json.JSONDecodeError:
        out["error"] = _first_error_line(p.stderr)
        return out
    out["json"] = data
    return out


def summarize(res: dict, n: int) -> dict:
    """The table's fields from a run's JSON (`n`: the model's decoder layers)."""
    data = res.pop("json", None)
    if data is None:
        return res
    plan = data["plan"]
    budget = data.get("budget") or {}
    layers, whole, segments = set(), set(), 0
    for e in plan["checkpoint"]:
        names = [e] if isinstance(e, str) else list(e)
        for x in names:
            i = _layer_index(x)
            if i is not None:
                layers.add(i)
                if str(x).split(".")[-1] == str(i):  # the whole decoder layer, not a part of it
                    whole.add(i)
        segments += 1
    res.update(
        batch_size=plan["batch_size"],
        grad_accum_steps=plan.get("grad_accum_steps"),
        checkpoint=plan["checkpoint"],
        checkpointed_layers=len(layers),
        partly_checkpointed_layers=len(layers - whole),
        checkpoint_segments=segments,
        decoder_layers=n,
        predicted_recompute_fraction=plan.get("predicted_recompute_fraction"),
        predicted_peak_bytes=plan.get("predicted_peak_bytes"),
        verified_peak_bytes=plan.get("verified_peak_bytes"),
        first_predicted_peak_bytes=plan.get("first_predicted_peak_bytes"),
        peft=plan.get("peft"),
        budget=budget,
        usable_budget_bytes=_usable(budget),
        recorded_steps=data.get("recorded_steps"),
        stage_seconds=data.get("stage_seconds"),
        tool_elapsed_s=data.get("elapsed_s"),
        notes=data.get("notes"),
    )
    return res


def _tree() -> str:
    """The code a cell ran on: the commit and, on a dirty tree, the hash of its changes (common.provenance)."""
    from benchmarks.common import provenance

    p = provenance()
    return p["short"] + ("" if p["clean"] else f"+dirty:{(p['diff_sha256'] or '')[:12]}")


def _layer_index(name: str) -> int | None:
    parts = str(name).split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _usable(budget: dict) -> int | None:
    for k in ("usable_bytes", "usable", "budget_bytes", "available_bytes"):
        if isinstance(budget.get(k), int):
            return budget[k]
    return None


# -- the CPU check: predicted vs the independent harness ---------------------------------------------
def cpu_check(timeout: int) -> list[dict]:
    import torch

    from ckpt_tune.measure.hf import load_hf_target
    from ckpt_tune.plan.finetune import PeftSpec
    from tests import harness

    def amp(loss_fn):
        def loss(model, batch):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return loss_fn(model, batch)
        return loss

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="qlora_bench_"))
    cfg = tmp / "tiny_llama.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    sys.path.insert(0, str(ROOT / "examples"))
    import qlora_gpt

    tiny = load_hf_target(cfg, seq_len=64, peft=PeftSpec("qlora"))
    cases = [
        ("tiny Llama (2 layers, hidden 128), --peft qlora --seq-len 64", "12MiB", 12 * MiB,
         ["--hf-config", str(cfg), "--peft", "qlora", "--seq-len", "64"],
         tiny.build_fn, tiny.batch_fn, lambda m, b: m(**b).loss),
        ("examples/qlora_gpt.py:build (a user's own QLoRA model)", "100MiB", 100 * MiB,
         ["examples/qlora_gpt.py:build"], qlora_gpt.build, qlora_gpt.make_batch, qlora_gpt.loss_fn),
    ]
    for name, vram, budget, spec, build, make_batch, loss_fn in cases:
        args = [*spec, "--device", "cpu", "--precision", "bf16-mixed", "--vram", vram]
        res = run_search(args, timeout)
        data = res.pop("json", None)
        row = {"case": name, "args": args, "budget_bytes": budget, **res}
        if data is not None:
            plan = data["plan"]
            entries = [tuple(e) if isinstance(e, list) else e for e in plan["checkpoint"]]
            build()  # bitsandbytes' and transformers' one-time tables, outside the measurement
            t0 = time.perf_counter()
            real = harness.measured_peak(build, make_batch, amp(loss_fn), plan["batch_size"], checkpoint=entries, count_build=True)
            row.update(batch_size=plan["batch_size"], checkpoint=plan["checkpoint"],
                       predicted_peak_bytes=plan["predicted_peak_bytes"], verified_peak_bytes=plan["verified_peak_bytes"],
                       harness_peak_bytes=real, harness_s=round(time.perf_counter() - t0, 1),
                       error_vs_harness=(plan["predicted_peak_bytes"] - real) / real, within_budget=real <= budget,
                       usable_budget_bytes=_usable(data.get("budget") or {}), budget=data.get("budget"))
        rows.append(row)
        print("cpu-check", {k: v for k, v in row.items() if k != "checkpoint"}, file=sys.stderr, flush=True)
    return rows


# -- the report -----------------------------------------------------------------------------------------
def _g(b) -> str:
    return f"{b / GiB:.2f}" if isinstance(b, (int, float)) else "-"


def _m(b) -> str:
    return f"{b / MiB:.2f}" if isinstance(b, (int, float)) else "-"


def cell_text(c: dict) -> list[str]:
    st = c["status"]
    if st == "not_run":
        return ["not run yet"] + ["-"] * 8
    if st == "implied_no_fit":
        return [f"does not fit (smaller than {c['implied_by']}, which does not fit); not run"] + ["-"] * 8
    if st == "timeout":
        return [f"TIMEOUT ({c['error']})", "-", "-", "-", "-", "-", str(c["wall_s"]), "-", "-"]
    code = c["exit_code"]
    rss = f"{c.get('max_rss_mib')} / {c.get('forked_max_rss_mib')}"
    if code == 3:
        return ["3 (nothing fits)", "-", "-", "-", "-", "-", str(c["wall_s"]), rss, c.get("error", "")[:160].replace("|", "/")]
    if "batch_size" not in c:
        return [f"{code} (FAILED)", "-", "-", "-", "-", "-", str(c["wall_s"]), rss, c.get("error", "")[:200].replace("|", "/")]
    part = c.get("partly_checkpointed_layers") or 0
    plan = (f"{c['checkpointed_layers']}/{c['decoder_layers']} layers{f' ({part} only in parts)' if part else ''} "
            f"in {c['checkpoint_segments']} checkpoints" if c["checkpoint"] else "no checkpointing")
    accum = f" (x{c['grad_accum_steps']} accum)" if (c.get("grad_accum_steps") or 1) > 1 else ""
    return [str(code), f"{c['batch_size']}{accum}", plan, f"{c['predicted_recompute_fraction']:.4f}" if c.get("predicted_recompute_fraction") is not None else "-",
            _g(c.get("predicted_peak_bytes")), _g(c.get("verified_peak_bytes")), str(c["wall_s"]), rss, ""]


def report(cells: dict, order: list[str], cpu_rows: list[dict] | None, cpu_status: str, selection: dict, finished: bool) -> None:
    done = [k for k in order if cells[k]["status"] in ("run", "timeout")]
    implied = [k for k in order if cells[k]["status"] == "implied_no_fit"]
    pending = [k for k in order if cells[k]["status"] == "not_run"]
    usable = {}
    for k in order:
        c = cells[k]
        if c.get("usable_budget_bytes"):
            usable[c["gb"]] = c["usable_budget_bytes"]
    lines = [
        ("The run finished." if finished else "**PARTIAL RUN** (the run was stopped or is still going): "
         f"{len(pending)} of {len(order)} cells not run yet; they are listed as such below."),
        f"Cells run: {len(done)}; implied no-fit (not run): {len(implied)}; not run yet: {len(pending)}."
        + (f" {sum(1 for k in done if cells[k].get('resumed'))} of the cells run were kept from an earlier run "
           "(--resume; each cell's `ran_at` and `tree` are in qlora.json)." if any(cells[k].get("resumed") for k in done) else ""),
        "",
        "Each cell: `ckpt-tune search --hf-config <config> --seq-len <seq> --device meta --precision bf16-mixed "
        "--peft <method> --vram <GB>GB --json` (default optimizer adamw, default LoRA settings), in a fresh child "
        "process (started by `/usr/bin/time`) with a timeout. Under `--device meta` everything is recorded under fake tensors with the CUDA "
        "allocator's rules: nothing is allocated, no GPU is needed.",
        "",
        "Legend:",
        "- budget: `--vram <N>GB`; ckpt-tune reads GB as GiB and holds back a CUDA context and a 5% margin, so the "
        "usable budget (from the JSON `budget`) is less: "
        + (", ".join(f"{gb} GB -> {usable[gb] / GiB:.2f} GiB" for gb in sorted(usable)) if usable else "(none recorded yet)") + ".",
        "- exit: ckpt-tune's exit code; 3 = nothing fits the budget (no plan).",
        "- **does not fit (smaller than X, which does not fit)**: NOT RUN. Budgets run from the largest down and stop "
        "at the first exit 3; a smaller budget cannot fit what a larger one cannot, so it is written as not fitting "
        "without running it.",
        "- batch: the largest micro-batch ckpt-tune found (with gradient accumulation steps if any).",
        "- plan: how many of the model's N decoder layers are inside a checkpoint, and in how many checkpoints "
        "(segments) the plan has; recompute: the predicted fraction of the step spent recomputing.",
        "- predicted / verified GiB: the plan's predicted peak and the peak of the recorded step that verified it.",
        "- wall s: the whole search, including starting Python; RSS MiB: the ckpt-tune process's peak RSS "
        "(getrusage in the process at exit) / the largest of the probe processes it forked (0: none).",
        "",
    ]
    headers = ["budget", "exit", "batch", "plan", "recompute", "predicted GiB", "verified GiB", "wall s", "RSS MiB (self / forked)", "note"]
    groups: dict = {}
    for k in order:
        c = cells[k]
        groups.setdefault((c["seq"], c["model"], c["method"]), []).append(c)
    for (seq, model, method), cs in groups.items():
        label = MODELS[model][0]
        lines += [f"### {label}, {method.upper() if method == 'qlora' else 'LoRA'}, seq {seq} ({n_layers(MODELS[model][1])} decoder layers)", ""]
        rows = []
        for c in sorted(cs, key=lambda c: c["gb"]):
            rows.append([f"{c['gb']} GB", *cell_text(c)])
        lines += [md_table(headers, rows), ""]
    # LoRA vs QLoRA where both fit
    cmp_rows = []
    for seq in SEQS:
        for model in MODELS:
            for gb in BUDGETS_GB:
                q, lo = cells.get(cell_key(model, "qlora", seq, gb)), cells.get(cell_key(model, "lora", seq, gb))
                if not q or not lo:
                    continue
                qb, lb = q.get("batch_size"), lo.get("batch_size")
                if qb is None and lb is None:
                    continue
                if q["status"] == "not_run" or lo["status"] == "not_run":
                    continue
                say = ("LoRA LARGER batch" if (lb or 0) > (qb or 0) else "QLoRA larger batch" if (qb or 0) > (lb or 0) else "same batch")
                cmp_rows.append([MODELS[model][0], seq, f"{gb} GB", qb if qb is not None else "no fit", lb if lb is not None else "no fit", say])
    if cmp_rows:
        lines += ["### QLoRA vs LoRA (largest batch, where at least one fits)", "", md_table(["model", "seq", "budget", "QLoRA batch", "LoRA batch", ""], cmp_rows), ""]
    failures = [cells[k] for k in order if cells[k]["status"] == "timeout" or (cells[k]["status"] == "run" and cells[k]["exit_code"] not in (0, 3))]
    lines += ["### Failures other than exit 3", ""]
    lines += [f"- {c['key']}: exit {c['exit_code']}: `{c.get('error', '')}`" for c in failures] or ["- none"]
    lines += [""]
    if pending:
        lines += ["### Cells not run yet", "", ", ".join(pending), ""]
    # the CPU check
    lines += ["## Small QLoRA models on the CPU, predicted vs the independent harness", ""]
    if cpu_rows is None:
        lines += [f"Not run ({cpu_status}).", ""]
    else:
        lines += [
            "`ckpt-tune search <target> --device cpu --precision bf16-mixed --vram <budget> --json`, then the plan "
            "measured by tests/harness.py's `measured_peak(build, make_batch, loss, batch, checkpoint=<plan's entries>, "
            "count_build=True)` with the loss under `torch.autocast(\"cpu\", dtype=torch.bfloat16)` (its own checkpoint "
            "wrappers and the CPU allocator's events; no ckpt-tune code). error = (predicted - harness) / harness; "
            "within budget: the harness's peak against the `--vram` given.",
            "",
        ]
        rows = []
        for r in cpu_rows:
            if "batch_size" not in r:
                rows.append([r["case"], _m(r["budget_bytes"]), f"exit {r.get('exit_code')}: {r.get('error', '')[:120]}", "-", "-", "-", "-", "-", "-"])
                continue
            rows.append([r["case"], f"{_m(r['budget_bytes'])} (usable {_m(r.get('usable_budget_bytes'))})", r["batch_size"],
                         f"{len(r['checkpoint'])} entries", _m(r["predicted_peak_bytes"]), _m(r["verified_peak_bytes"]), _m(r["harness_peak_bytes"]),
                         f"{100 * r['error_vs_harness']:+.3f}%", "yes" if r["within_budget"] else "NO"])
        lines += [md_table(["target", "budget MiB", "batch", "checkpoint", "predicted MiB", "verified MiB", "harness MiB", "error", "within budget"], rows), ""]
        lines += [f"- {r['case']}: checkpoint = `{r.get('checkpoint')}`" for r in cpu_rows if "checkpoint" in r]
        lines += [""]
    lines += ["Selection of this run: " + json.dumps(selection)]
    write_results("qlora", "LoRA and QLoRA plans for Llama models under fake tensors",
                  {"finished": finished, "selection": selection, "order": order, "cells": cells,
                   "cpu_check": cpu_rows, "cpu_check_status": cpu_status}, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--methods", nargs="*", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--only-seq", nargs="*", type=int, choices=list(SEQS), default=list(SEQS))
    ap.add_argument("--budgets", nargs="*", type=int, default=list(BUDGETS_GB), help="GB, run largest first")
    ap.add_argument("--quick", action="store_true", help="Llama-2-7B, seq 2048, qlora and lora only")
    ap.add_argument("--no-cpu-check", action="store_true", help="leave out the small-model CPU check")
    ap.add_argument("--cpu-check-last", action="store_true", help="run the CPU check after the grid (default: first)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--resume", action="store_true", help="keep the cells (and the CPU check) already run in "
                    "results/qlora.json with the same arguments; each cell records when and on which tree it ran")
    a = ap.parse_args()
    if a.quick:
        a.models, a.only_seq = ["7b"], [2048]
    models = [m for m in MODELS if m in a.models]
    budgets = sorted(set(a.budgets), reverse=True)
    order, cells = [], {}
    for seq in [s for s in SEQS if s in a.only_seq]:
        for model in models:
            for method in [m for m in METHODS if m in a.methods]:
                for gb in budgets:
                    k = cell_key(model, method, seq, gb)
                    order.append(k)
                    cells[k] = {"key": k, "model": model, "method": method, "seq": seq, "gb": gb,
                                "args": cell_args(model, method, seq, gb), "status": "not_run"}
    resumed, cpu_resumed = 0, None
    saved = ROOT / "benchmarks" / "results" / "qlora.json"
    if a.resume and saved.exists():
        old = json.loads(saved.read_text())
        for k, c in old.get("cells", {}).items():
            if k in cells and c.get("args") == cells[k]["args"] and c["status"] in ("run", "implied_no_fit"):
                cells[k] = {**c, "resumed": True}
                resumed += 1
        if old.get("cpu_check_status") == "run" and not a.no_cpu_check:
            cpu_resumed = old.get("cpu_check")
    selection = {"models": models, "methods": a.methods, "seqs": a.only_seq, "budgets_gb": budgets, "quick": a.quick, "timeout_s": a.timeout}
    selection["resumed_cells"] = resumed
    cpu_rows, cpu_status = None, "left out (--no-cpu-check)" if a.no_cpu_check else "not run yet"
    if cpu_resumed:
        cpu_rows, cpu_status = cpu_resumed, "run"
    report(cells, order, cpu_rows, cpu_status, selection, finished=False)

    def do_cpu():
        nonlocal cpu_rows, cpu_status
        cpu_rows, cpu_status = cpu_check(a.timeout), "run"
        report(cells, order, cpu_rows, cpu_status, selection, finished=False)

    if not a.no_cpu_check and not a.cpu_check_last and cpu_rows is None:
        do_cpu()
    for k in order:
        c = cells[k]
        if c["status"] != "not_run":
            continue
        stamp = {"ran_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "tree": _tree()}
        res = run_search(c["args"], a.timeout)
        c.update(summarize(res, n_layers(MODELS[c["model"]][1])), **stamp)
        print(k, {x: c.get(x) for x in ("exit_code", "batch_size", "checkpointed_layers", "checkpoint_segments", "predicted_recompute_fraction",
                                          "predicted_peak_bytes", "verified_peak_bytes", "wall_s", "max_rss_mib", "error")}, file=sys.stderr, flush=True)
        if c.get("exit_code") == 3:  # nothing fits: the smaller budgets of this column cannot fit either
            for k2 in order:
                c2 = cells[k2]
                if (c2["model"], c2["method"], c2["seq"]) == (c["model"], c["method"], c["seq"]) and c2["gb"] < c["gb"] and c2["status"] == "not_run":
                    c2.update(status="implied_no_fit", implied_by=f"{c['gb']} GB")
        report(cells, order, cpu_rows, cpu_status, selection, finished=False)
    if not a.no_cpu_check and a.cpu_check_last and cpu_rows is None:
        do_cpu()
    report(cells, order, cpu_rows, cpu_status, selection, finished=True)


if __name__ == "__main__":
    main()
