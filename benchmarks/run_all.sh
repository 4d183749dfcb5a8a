#!/usr/bin/env bash
# Rewrite every file in benchmarks/results/ at one commit. On a clean clone (after `make setup`):
#     benchmarks/run_all.sh                 # refuses a work tree that differs from HEAD
#     benchmarks/run_all.sh --allow-dirty   # runs anyway; each result records the dirty paths and a hash of git diff HEAD
# About two and a half hours on a 2-core machine (qlora: an hour) (large_model, plan_quality, ops and batch_finder dominate); each script
# also runs on its own. Timing benchmarks (plan_quality, batch_finder, speed, large_model) want a quiet machine.
# The GPU check is separate: .venv/bin/python benchmarks/gpu_validate.py (a CUDA machine, < 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export TORCH_CPP_LOG_LEVEL=ERROR
if [[ "${1:-}" == "--allow-dirty" ]]; then
    export CKPT_TUNE_BENCH_ALLOW_DIRTY=1  # benchmarks/common.py reads it (child processes inherit it)
fi
head=$(git rev-parse HEAD)
if [[ "${CKPT_TUNE_BENCH_ALLOW_DIRTY:-}" != "1" ]] && [[ -n "$(git status --porcelain --untracked-files=all -- . ':(exclude)benchmarks/results')" ]]; then
    echo "run_all.sh: the work tree differs from HEAD; commit first or pass --allow-dirty" >&2
    exit 2
fi
run() { echo "== $*" >&2; "$PY" "$@"; }
run benchmarks/accuracy.py
run benchmarks/fake_accuracy.py
run benchmarks/fake_memo.py
run benchmarks/plan_quality.py
# a partial run of the peers (HF GPT-2 only) made before the full run included them: superseded
rm -f benchmarks/results/plan_quality_peers.json benchmarks/results/plan_quality_peers.md
run benchmarks/plot.py
run benchmarks/batch_finder.py
run benchmarks/speed.py
run benchmarks/nested.py
run benchmarks/zoo.py
run benchmarks/large_model.py
run benchmarks/same_plans.py
# written by other changes: run where they exist
for extra in benchmarks/ops.py benchmarks/sharded.py benchmarks/peft_archs.py benchmarks/qlora.py; do
    if [[ -f "$extra" ]]; then run "$extra"; fi
done
# every result must come from this commit
if [[ "$(git rev-parse HEAD)" != "$head" ]]; then
    echo "run_all.sh: HEAD moved during the run ($head -> $(git rev-parse HEAD))" >&2
    exit 1
fi
"$PY" - "$head" <<'PY'
import json, sys, pathlib
head, bad = sys.argv[1], []
for p in sorted(pathlib.Path("benchmarks/results").glob("*.json")):
    if p.name == "gpu_validate.json":  # a CUDA machine's run, made separately
        continue
    prov = json.loads(p.read_text()).get("provenance") or {}
    if prov.get("commit") != head:
        bad.append(f"{p.name}: {prov.get('commit', 'no provenance')}")
if bad:
    sys.exit("results not from " + head + ": " + "; ".join(bad))
print(f"all results from {head[:7]}", file=sys.stderr)
PY
