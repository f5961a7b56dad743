# Set-up is `make demo` or `make test` on a fresh machine: each builds .venv first.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
# The torchft extra runs torchft's Manager against ftcomm in the tests.
EXTRAS ?= dev,torchft
VENV ?= .venv
PY := $(VENV)/bin/python
comma := ,
STAMP := $(VENV)/.installed-$(TORCH_VERSION)-$(subst $(comma),-,$(EXTRAS))

.PHONY: install test unit lint typecheck demo bench bench-page chaos scale soak gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	# nftables, for the network faults of ftcomm.testing (docs/testing.md): as root
	# with apt-get, where nft is missing; elsewhere nothing (those tests skip).
	@if ! command -v nft >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q nftables >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q nftables >/dev/null; } \
			|| echo "nftables could not be installed: the network-fault tests will skip"; \
	fi
	# etcd, for the etcd clusters of ftcomm.testing (docs/testing.md): the same way.
	@if ! command -v etcd >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q etcd-server etcd-client >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q etcd-server etcd-client >/dev/null; } \
			|| echo "etcd could not be installed: the etcd tests will skip"; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

test: install lint typecheck unit

# The suite on TEST_WORKERS processes (pytest-xdist; 3 on the 2-core CI box,
# where many tests wait on deadlines and peers); TEST_WORKERS=0 runs it in
# this process alone. One test at a time to a worker: the slow tests, sorted
# first (tests/conftest.py), then spread over all of them.
TEST_WORKERS ?= 3
unit: install
	FTCOMM_DEBUG=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 1

lint: install
	$(PY) -m ruff check ftcomm tests examples scripts
	$(PY) -m ruff format --check ftcomm tests examples scripts

typecheck: install
	$(PY) -m mypy

demo: install
	$(PY) examples/recover_from_dead_rank.py

bench: install
	$(PY) -m ftcomm bench

# Measure with every rank pinned, keep the JSON beside docs/performance.md,
# and rewrite that page's bench section from it (scripts/performance_page.py).
bench-page: install
	$(PY) -m ftcomm bench --pin --json docs/bench.json
	$(PY) scripts/performance_page.py docs/bench.json

# The chaos soak: ftcomm at 3, 4 and 8 members and torchft's Manager at 3 and
# 4, each CHAOS_SECONDS without faults, then as long with a fault every 5 or
# 10 s (about 11-12 minutes at 60 s on 2 cores; CHAOS_SECONDS=20 for a look).
CHAOS_SECONDS ?= 60
chaos: install
	$(PY) -m ftcomm bench --chaos --chaos-seconds $(CHAOS_SECONDS)

# Join and kill-to-good-step times and the store's load per heartbeat round,
# at 3, 8, 16 and 32 members (3-6 minutes on 2 cores).
scale: install
	$(PY) -m ftcomm bench --scale

# The abort drills at full size (tests/test_abort_drill.py): 2000 seeded
# in-process trials, 200 subprocess ones, 50 copy-back kills (about an hour
# on 2 cores; the default suite runs 60, 6 and 3); and the fusion drill at
# 2000 seeds (the default suite: 100).
SOAK_TRIALS ?= 2000
SOAK_SUB_TRIALS ?= 200
SOAK_COPY_TRIALS ?= 50
SOAK_FUSE_SEEDS ?= 2000
soak: install
	FTCOMM_DEBUG=1 FTCOMM_DRILL_TRIALS=$(SOAK_TRIALS) FTCOMM_DRILL_SUB_TRIALS=$(SOAK_SUB_TRIALS) \
	FTCOMM_DRILL_COPY_TRIALS=$(SOAK_COPY_TRIALS) $(PY) -m pytest -q -o timeout=0 tests/test_abort_drill.py
	FTCOMM_DEBUG=1 FTCOMM_FUSE_SEEDS=$(SOAK_FUSE_SEEDS) $(PY) -m pytest -q -o timeout=0 \
		tests/test_fuse.py -k every_rank_fuses_alike

# On a GPU machine: NCCL checks and a bench against raw c10d NCCL, with that
# machine's own python3 and torch (nothing installed: it may have no
# network); a log and a JSON of figures land in $(OUT). Under 8 minutes.
GPU_PYTHON ?= python3
OUT ?= gpu-check-out
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) scripts/gpu_check.py $(OUT)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis gpu-check-out
