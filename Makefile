# Sailfish: the two commands a new user needs are `make test` and `make serve` (see README.md).
PY      := .venv/bin/python
PIP     := env PIP_CONSTRAINT=$(CURDIR)/constraints.txt .venv/bin/pip
# Each long step says what it does and how long it takes, then prints a line at least every 10 s.
PHASE   := python3 common/progress.py
STAMP   := .venv/.installed
SPEEDUPS := .venv/.speedups-built
PORT    ?= 22343

.PHONY: venv test test-fast index serve bench bench-quick bench-full fuzz clean

venv: $(SPEEDUPS)

# torch is installed first and pinned (constraints.txt) so nothing pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt setup.py
	@echo "Installing Sailfish into .venv (once; about 2-3 min on a fresh machine; later runs skip this)"
	@$(PHASE) "creating .venv" "seconds" -- python3 -m venv .venv
	@$(PHASE) "upgrading pip" "seconds" -- $(PIP) install -qq --upgrade pip
	@$(PHASE) "installing torch 2.13 (CPU build)" "about 1 min" -- $(PIP) install -qq torch==2.13.0
	@$(PHASE) "installing Sailfish and its dependencies" "about 1 min" -- $(PIP) install -qq -e '.[test]'
	@# bfcl-eval's declared dependencies pull torch/CUDA; its data (the starter corpus) needs none
	@$(PHASE) "installing the BFCL v4 data" "seconds" -- $(PIP) install -qq --no-deps bfcl-eval
	@touch $(STAMP)

# The C kernels (ngram/_speedups.c, server/_cpu_*.c and _cpu_kernels.h) are built by the editable install; rebuilt when edited.
$(SPEEDUPS): ngram/_speedups.c $(wildcard server/_cpu_*.c server/_cpu_*.h) $(STAMP)
	@$(PHASE) "building the C kernels" "seconds" -- $(PIP) install -qq --no-deps -e .
	@touch $(SPEEDUPS)

test: $(SPEEDUPS)
	$(PY) -m pytest

test-fast: $(SPEEDUPS)
	$(PY) -m pytest -q -m "not slow"

# 10,000 hostile requests against a real server on the bundled model: no 5xx, memory steady (bench/fuzz.py).
fuzz: $(SPEEDUPS)
	$(PY) -m bench.fuzz --requests 10000

index: $(SPEEDUPS)
	$(PY) -m index build

# Stop with Ctrl-C. The server exits quietly on SIGINT and SIGTERM (make itself reports a SIGTERM sent to it).
serve: $(SPEEDUPS)
	@$(PY) -c "from common.paths import default_index_dir as d; import sys; sys.exit(0 if (d()/'current').exists() else 1)" \
		|| { echo "No index yet: building the default one (once; about 10 s, up to a minute on a busy machine)"; \
		     $(PY) -m index build; }
	@$(PY) -m server --port $(PORT)

clean:
	rm -rf .venv build *.egg-info .pytest_cache

# The benchmark's peers build from source (llama.cpp takes a few minutes the first time).
BENCH_STAMP := .venv/.bench-installed
$(BENCH_STAMP): $(SPEEDUPS)
	$(PIP) install -qq arctic-inference==0.3.0 numpy matplotlib
	$(PIP) install -qq llama-cpp-python==0.3.36
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench
	$(PY) -m bench.cpu_path --requests 10

bench-quick: $(BENCH_STAMP)
	$(PY) -m bench --quick

bench-full: $(BENCH_STAMP)
	$(PY) -m bench --full
