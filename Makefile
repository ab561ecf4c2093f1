# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv as needed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pinned: the CPU build of this version is what the project's machines carry locally; an open
# range would fetch a multi-GB CUDA build. On a GPU machine install the CUDA build you need.
TORCH_VERSION ?= 2.13.0

.PHONY: demo test test-long test-ray bytecode lint bench scale soak soak-test clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,torch,report,trl,crypto,jax,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Three pytest workers, each with its own Temporal dev server and control worker; a test file
# stays on one worker (its module fixtures are shared). Most tests wait on processes and
# servers, so three fit two cores: 399 s of pytest against 511 s with two (2026-12-01). Four
# were faster (545 s against 690 s in place, 2026-12-02) but the cooperative switches' byte
# count failed under them in two of five runs (BENCHMARKS.md). TEST_WORKERS=0 runs everything
# in one. The slowest tests are listed at the end, so a run that nears the ten-minute budget
# says where its time went. The Ray tests (make test-ray) are not even collected: each worker
# would import Ray for them.
TEST_WORKERS ?= 3
test: $(STAMP) bytecode
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "not ray and not long" --ignore=tests/test_ray.py

# The tests marked `long` (the slowest end-to-end tests: TRL's two time-sliced trainers and
# one alone, the demo's three runs, the 30-s soak with every fault kind; since the fourth
# session, the raw and the maximal-message update floods, which starve whatever shares the
# cores with them, and a pool's drifting job and its async move): 222 s of the slowest tests'
# time in a 625-s `make test` (2026-12-03) first, which then ran past ten minutes on two
# cores; apart from it, as the Ray tests are. `.ci/run` runs all three targets.
test-long: $(STAMP) bytecode
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 -m long --ignore=tests/test_ray.py

# The project's own modules compiled once, before the tests start hundreds of fresh processes
# that import them: with PYTHONDONTWRITEBYTECODE set (as on the project's machines) each such
# process compiled them again, 0.6-0.7 s of CPU for one that imports the CLI and the control
# worker. The tests run with it unset, so pytest keeps its rewritten test modules too.
SOURCES = client protocol transport cli workflows activities workers snapshot workloads plan \
	integrations report tests examples bench
bytecode: $(STAMP)
	$(PY) -m compileall -q $(SOURCES) > /dev/null

# The Ray tests (tests/test_ray.py, marker `ray`: a two-node Ray cluster on this machine, 8 rank
# actors, two 4-rank jobs, faults): 224-250 s on two cores at load 12-15 (BENCHMARKS.md), so
# apart from `make test`'s budget; `.ci/run` runs both.
test-ray: $(STAMP) bytecode
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q tests/test_ray.py --durations=10

# The soak's tests alone (tests/test_soak.py: the 30-s soak with every fault kind, its command line,
# the dropped-connection regression); `make test` runs the last two, `make test-long` the soak.
soak-test: $(STAMP)
	$(PY) -m pytest -q tests/test_soak.py

# Every kustomization under deploy/kubernetes: rendered offline and validated against the
# Kubernetes schemas (oldest supported and newest shipped), as tests/test_deploy.py also does.
KUSTOMIZATIONS = $(sort $(dir $(wildcard deploy/kubernetes/*/kustomization.yaml deploy/kubernetes/*/*/kustomization.yaml)))
KUBE_VERSIONS ?= 1.30.0 1.37.0

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/shellcheck deploy/slurm/*.sh deploy/slurm/*.sbatch
	set -e; for k in $(KUSTOMIZATIONS); do \
		rendered=$$($(VENV)/bin/kubectl kustomize $$k); \
		for v in $(KUBE_VERSIONS); do \
			printf '%s\n' "$$rendered" \
				| $(VENV)/bin/kubernetes-validate --strict --quiet -k $$v -; \
		done; \
		echo "$$k: rendered and valid against Kubernetes $(KUBE_VERSIONS)"; \
	done

bench: $(STAMP)
	$(PY) bench/handoff.py --handoffs 2000

# Many RL jobs on one control plane (bench/scale.py; BENCHMARKS.md, "Control-plane scale").
SCALE_JOBS ?= 40
SCALE_GROUPS ?= 10
scale: $(STAMP)
	$(PY) bench/scale.py --jobs $(SCALE_JOBS) --groups $(SCALE_GROUPS) --epochs 4

# 30 minutes of contenders and RL jobs on one group while holders, waiters, job processes and
# the control worker are killed and the server restarts (bench/soak.py; BENCHMARKS.md). Niced:
# it shares the machine with whatever else runs.
SOAK_SEED ?= 1
soak: $(STAMP)
	nice -n 10 $(PY) bench/soak.py --duration 1800 --seed $(SOAK_SEED) \
		--out .timeslice/soak-$$(date +%Y%m%d-%H%M%S)

clean:
	rm -rf $(VENV) .timeslice test-artifacts
