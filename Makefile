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
PYTEST_ARGS ?=
DEEPSPEED_VERSION ?= 0.19.8

.PHONY: setup setup-nvme demo test test-fast clean help system-deps slurm

help:
	@echo "make setup   create $(VENV) and install the suite (CPU torch pinned on CPU machines)"
	@echo "make demo    setup, then the main job: every backend on the embedded corpus, compared"
	@echo "make test-fast  the unit tier: every test that starts no process (-m unit; docs/testing.md)"
	@echo "make test    setup (with DeepSpeed's NVMe op where libaio installs), then the test suite (CI runs this)"
	@echo "make setup-nvme  add DeepSpeed's async_io op (NVMe offload) to $(VENV)"
	@echo "make slurm   install munge and Slurm from Debian's packages (root), for tools/slurm_local.sh start"
	@echo "make clean   remove $(VENV) and run records (runs/ keeps README.md and reference/)"

setup: $(VENV)/.installed

# What the demo needs: torch, DeepSpeed with the CPU ops every run uses, the suite and its
# dependencies. The test tools and DeepSpeed's NVMe op come with `make test` (below). numpy comes
# with torch: building DeepSpeed imports torch, which warns without it.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) tools/install_deepspeed.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) torch numpy
	tools/install_deepspeed.sh $(PY) $(DEEPSPEED_VERSION)
	$(PY) -m pip install --disable-pip-version-check -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e .
	touch $@

# DeepSpeed's async_io op too (NVMe offload, ZeRO-Infinity to a drive). Needs libaio.
setup-nvme: $(VENV)/.nvme
$(VENV)/.nvme: $(VENV)/.installed
	@$(MAKE) --no-print-directory system-deps
	tools/install_deepspeed.sh $(PY) $(DEEPSPEED_VERSION) nvme
	touch $@

# What the tests need beyond the demo: pytest and the notebook tools, and the NVMe op (a test
# offloads to a directory).
$(VENV)/.test: $(VENV)/.nvme
	$(PY) -m pip install --disable-pip-version-check -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev]'
	touch $@

# libaio, for DeepSpeed's NVMe offload (its async_io op). Best effort: without it, NVMe offload
# is refused with a message and its test is skipped.
system-deps:
	@if [ -f /usr/include/libaio.h ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "Installing libaio-dev (DeepSpeed NVMe offload)"; \
		apt-get install -y -qq libaio-dev >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libaio-dev >/dev/null 2>&1; } || \
		echo "note: could not install libaio-dev; DeepSpeed NVMe offload will be unavailable"; \
	else echo "note: libaio-dev is not installed (sudo apt-get install libaio-dev); DeepSpeed NVMe offload will be unavailable"; fi

# A one-node Slurm on this machine (sweep.py --executor slurm): Debian's munge, slurmctld, slurmd
# and slurm-client; then `tools/slurm_local.sh start`.
slurm:
	tools/slurm_local.sh install

# The main job: every backend configuration, checkpointing off and on, on 2 CPU ranks
# (sweeps/cpu_quick.yaml), then the comparison report. Runs already recorded are skipped.
DEMO_SPEC ?= sweeps/cpu_quick.yaml
REPORT_DIR ?= reports/cpu_quick
demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) sweep.py $(DEMO_SPEC)
	$(PY) -m analysis.report runs/sweeps/cpu_quick --out $(REPORT_DIR)
	@echo "Report: $(REPORT_DIR)/report.md"

# Tests run in TEST_WORKERS pytest-xdist processes, a test module to a worker (their fixtures are
# per module); the launches several modules read are made once and shared (tests/support/launches.py).
# TEST_WORKERS=0: in this process, one test after another.
TEST_WORKERS ?= 2
test: $(VENV)/.test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The inner loop: the unit tier, the tests that start no process (docs/testing.md). `make test` runs
# every tier: unit, launch, distributed, slurm (gpu where a GPU is). In one process: two workers'
# start-up cost more than they saved here (make test-fast 145 s with two, 90 s in one, 2026-11-27).
test-fast: $(VENV)/.test
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
	find runs -mindepth 1 -maxdepth 1 ! -name README.md ! -name reference -exec rm -rf {} +
