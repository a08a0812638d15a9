# Two commands do all the set-up on a fresh machine (see README.md):
#   make demo   - a real 2-rank DDP job on CPU with ddpscope attached and recording
#   make test   - the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
NPROC ?= 2
RUNS ?= runs

.PHONY: setup demo test test-unit test-e2e test-frameworks lint bench hooks clean bytecode

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch==2.13.0 is the CPU wheel this machine keeps on disk; an unpinned
	# torch would pull a multi-GB CUDA build. numpy is torch's, not ours: torch
	# warns without it and all_gather_object needs it.
	$(PY) -m pip install -q torch==2.13.0 numpy
	$(PY) -m pip install -q -e '.[dev]'
	# The frameworks test tier runs real installs, pinned; torch is named again so
	# that the resolver keeps the CPU wheel instead of pulling another build.
	$(PY) -m pip install -q torch==2.13.0 pytorch-lightning==2.6.6 transformers==5.23.0 \
		accelerate==1.15.0 pytorch-ignite==0.5.5
	rm -f $(VENV)/.installed-*
	touch $@

# The demo job has a straggler on purpose (rank 1 sleeps 40 ms a step), so
# that the watcher has something to find; on a terminal the UI opens beside it.
demo: $(STAMP)
	$(PY) -m ddpscope run --record $(RUNS) -- \
		$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) \
		demos/train.py --epochs 8 --slow-rank 1 --slow-ms 40
	$(PY) -m ddpscope report $(RUNS)

# The slowest tests are listed at the end: the suite must stay well under 20 minutes.
# One worker per core, a test file to a worker at a time (a file's module-scoped
# jobs then run once); PYTEST_WORKERS=0 runs it in this process alone.
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist loadfile
test: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) --durations=25

# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), every
# process of every test job compiled ddpscope from source: ~0.15 s of CPU a rank.
# Python still reads bytecode written beforehand, so the tests write it once.
bytecode: $(STAMP)
	$(PY) -m compileall -q ddpscope tests demos > /dev/null

# The in-process tests alone, or the real jobs, processes, sockets and
# terminals alone.
test-unit: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) tests/unit

test-e2e: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) tests/e2e

# The tier of real Lightning, transformers/accelerate and torch.compile jobs
# alone (`make test` runs it too).
test-frameworks: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) -m frameworks

lint: $(STAMP)
	$(VENV)/bin/ruff check ddpscope tests demos benchmarks
	$(VENV)/bin/ruff format --check ddpscope tests demos benchmarks
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m benchmarks.overhead

hooks:
	git config core.hooksPath hooks

clean:
	rm -rf $(VENV) $(RUNS) .pytest_cache .mypy_cache .ruff_cache
