# Fresh machine with only python3: `make demo`, `make test` or `make test-nodes`.
#
# torch is pinned and installed FIRST: a CPU build of torch $(TORCH_VERSION) lies on this
# machine's disk, while an unpinned `pip install torch` (or letting torchdata pull torch in)
# would download a multi-GB CUDA build. With torch already present, torchdata and the
# package's own `torch>=2` requirement install nothing more.
#
# $(STAMP) records that .venv is set up; it depends on setup.cfg, pyproject.toml and this Makefile, so the
# install steps rerun only when those change (or after `make clean`).

.POSIX:

PYTHON = python3
VENV = .venv
TORCH_VERSION = 2.13.0
TORCHDATA_VERSION = 0.9.0
PIP = $(VENV)/bin/python -m pip --disable-pip-version-check
STAMP = $(VENV)/.installed
BENCH_STAMP = $(VENV)/.installed-bench
# The second environment: torchdata 0.11 (no DataLoader2) for the torch DataLoader and torchdata.nodes front ends.
NODES_VENV = .venv-nodes
NODES_TORCHDATA_VERSION = 0.11.0
NODES_PIP = $(NODES_VENV)/bin/python -m pip --disable-pip-version-check
NODES_STAMP = $(NODES_VENV)/.installed

all: test

demo: $(STAMP)
	$(VENV)/bin/python examples/quickstart.py

# Three test processes (most tests wait on worker processes, not the CPU); a file's tests
# stay together, so module fixtures (the network-namespace cluster) are made once; files are
# handed out in collection order, which tests/conftest.py makes longest first.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder -m "not slurm and not system"

# The whole-system runs (tests marked `system` in tests/conftest.py): examples/ddp_train.py and the
# launch recipes under torchrun, the benchmark harness, and worker hosts in network namespaces.
test-system: $(STAMP)
	$(VENV)/bin/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder -m system

# The front ends that need no DataLoader2 (tests/nodes/), in $(NODES_VENV) with torchdata
# $(NODES_TORCHDATA_VERSION); the DataLoader2 tests are not collected there (tests/nodes/conftest.py).
test-nodes: $(NODES_STAMP)
	$(NODES_VENV)/bin/python -m pytest -p no:cacheprovider tests/nodes

# Opt-in (not in `make test`): examples/slurm_hetjob.sbatch submitted to a real single-node
# Slurm. Installs slurm-wlm and munge when missing; as not root, or where it cannot, the
# test skips with the reason (exit 0). About 30 s.
test-slurm: $(STAMP)
	bash .ci/install-slurm
	$(VENV)/bin/python -m pytest -m slurm tests/test_slurm.py

# The published run: tables on stdout, and benchmarks/RESULTS.md, results.json, results.png;
# then the front ends without DataLoader2 (bench-nodes, torchdata $(NODES_TORCHDATA_VERSION)) add their section to RESULTS.md,
# and the elastic fleet (bench-elastic) writes ELASTIC.md.
bench: $(BENCH_STAMP) $(NODES_STAMP)
	$(VENV)/bin/python benchmarks/bench.py --json benchmarks/results.json --plot benchmarks/results.png \
		--results-md benchmarks/RESULTS.md
	$(MAKE) bench-nodes
	$(MAKE) bench-elastic

# RemoteMapper vs ParallelMapper, RemoteIterable vs torch's DataLoader: their section of RESULTS.md.
bench-nodes: $(NODES_STAMP)
	$(NODES_VENV)/bin/python benchmarks/bench_frontends.py --results-md benchmarks/RESULTS.md

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python setup.cfg pyproject.toml Makefile
	$(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install "torchdata==$(TORCHDATA_VERSION)"
	$(PIP) install -e '.[dataloader2,test,examples]'
	touch $(STAMP)

$(NODES_VENV)/bin/python:
	$(PYTHON) -m venv $(NODES_VENV)

$(NODES_STAMP): $(NODES_VENV)/bin/python setup.cfg pyproject.toml Makefile
	$(NODES_PIP) install "torch==$(TORCH_VERSION)"
	$(NODES_PIP) install "torchdata==$(NODES_TORCHDATA_VERSION)"
	$(NODES_PIP) install -e '.[nodes,test]'
	touch $(NODES_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PIP) install -e '.[dataloader2,test,examples,bench]'
	touch $(BENCH_STAMP)

clean:
	rm -rf $(VENV) $(NODES_VENV) build dist .pytest_cache .hypothesis .ruff_cache
	rm -rf *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Servers joining and draining under "dynamic", and the autoscaler against fixed fleets (about 2 minutes):
# benchmarks/ELASTIC.md and the figure benchmarks/elastic.svg. A MISS among its verdicts does not fail make.
bench-elastic: $(STAMP)
	-$(VENV)/bin/python benchmarks/bench_elastic.py --plot benchmarks/elastic.svg --results-md benchmarks/ELASTIC.md

.PHONY: all demo test test-system test-nodes test-slurm bench bench-nodes bench-elastic clean
