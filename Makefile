# Two commands set everything up on a fresh machine:
#   make demo   create .venv if missing, install, and run the main job
#   make test   the test suite (what CI runs)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines get the CPU build of torch pinned (an unpinned torch pulls gigabytes of CUDA
# wheels). Where nvidia-smi exists the pin is dropped: bring your own CUDA torch, or let pip
# choose. Override with `make setup CONSTRAINTS=` or CONSTRAINTS=yourfile.txt.
CONSTRAINTS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,constraints-cpu.txt)
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=

.PHONY: setup demo test clean help

help:
	@echo "make setup   create $(VENV) and install the suite (CPU torch pinned on CPU machines)"
	@echo "make demo    setup, then the main job: every backend on the embedded corpus, compared"
	@echo "make test    setup, then the test suite (CI runs this)"
	@echo "make clean   remove $(VENV) and run records (runs/ keeps README.md and reference/)"

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev]'
	touch $@

# For now the main job is single vs DDP on two CPU processes at the same global batch.
demo: setup
	$(PY) train.py --backend single --preset tiny --steps 60 --micro_batch 16 \
		--runs_dir $(DEMO_DIR) --run_name single --overwrite --log_every 10
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 train.py --backend ddp --preset tiny --steps 60 \
		--micro_batch 8 --runs_dir $(DEMO_DIR) --run_name ddp --overwrite --log_every 10
	$(PY) -m analysis.table $(DEMO_DIR)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
	find runs -mindepth 1 -maxdepth 1 ! -name README.md ! -name reference -exec rm -rf {} +
