# make demo: set up .venv if needed and run the main job on the bundled GPT example.
# make test: the same set-up, then the whole test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-heavy zoo sweep setup lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch==2.13.0 only when no torch is importable: a user's own (CUDA) build is kept.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	@# deepspeed ships as an sdist whose build imports torch: build it against this torch, no ops compiled
	$(BIN)/python -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed==0.19.8"
	$(BIN)/pip install -q -e ".[dev,gpu]"
	@# PyPI's torchvision extension is built for CUDA torch: let its pure-Python models import beside the CPU one
	$(BIN)/python tests/torchvision_compat.py
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/ckpt-tune search examples/gpt.py:build --device cpu --vram 160MiB --out ckpt_tune.yaml --patch ckpt_tune_patch.py

test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q
	@# once more on a lesser CPU: oneDNN limited to AVX2 (no AVX-512, no bf16 kernels), wherever this runs
	ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest -q tests/test_fake.py tests/test_profile.py tests/test_machine_errors.py

# the slow members only (also part of `make test`)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# the heavy members (minutes each; not part of `make test`): the README's 24 GB search, the longest searches
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -m heavy

# the conformance zoo (tests/zoo: torchvision, timm, transformers, peft, plain torch), every check
# including the heavy searches, then its table: benchmarks/results/zoo.json and zoo.md (written even when
# tests fail: a failing row is reported as failing); exits with pytest's status
zoo: $(STAMP)
	$(BIN)/python -m pytest -q tests/zoo -m ''; status=$$?; $(BIN)/python benchmarks/zoo.py && exit $$status

# the sweep: every architecture of transformers' LM/seq2seq/image/speech auto mappings, torchvision's classification
# and segmentation models, one small timm model per family and four diffusers models, through profile, search
# and apply against the harness (benchmarks/sweep.py, a forked process per architecture, two at a time): writes
# benchmarks/results/sweep.json and sweep.md (about 1.5 h on 2 cores); its stratified subset is tests/test_sweep.py
sweep: $(STAMP)
	$(BIN)/python benchmarks/sweep.py --jobs 2

lint: $(STAMP)
	$(BIN)/ruff check ckpt_tune tests

clean:
	rm -rf $(VENV) build *.egg-info
