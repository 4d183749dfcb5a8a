#!/usr/bin/env bash
# Run benchmarks 1-4 and rewrite benchmarks/results/. About 30-40 minutes on an idle 2-core machine
# (accuracy and plan quality dominate); each script also runs on its own.
# The GPU check is separate: .venv/bin/python benchmarks/gpu_validate.py (a CUDA machine, < 8 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export TORCH_CPP_LOG_LEVEL=ERROR
"$PY" benchmarks/accuracy.py
"$PY" benchmarks/plan_quality.py
"$PY" benchmarks/plot.py
"$PY" benchmarks/batch_finder.py
"$PY" benchmarks/speed.py
