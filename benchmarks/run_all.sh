#!/usr/bin/env bash
# Run benchmarks 1-4 and rewrite benchmarks/results/. About 20 minutes on the 2-core machine
# (plan quality and speed dominate); each script also runs on its own.
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
