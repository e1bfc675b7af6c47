# Sailfish: the two commands a new user needs are `make test` and `make serve` (see README.md).
PY      := .venv/bin/python
PIP     := PIP_CONSTRAINT=$(CURDIR)/constraints.txt .venv/bin/pip
STAMP   := .venv/.installed
SPEEDUPS := .venv/.speedups-built
PORT    ?= 22343

.PHONY: venv test test-fast index serve bench bench-quick bench-full fuzz clean

venv: $(SPEEDUPS)

# torch is installed first and pinned (constraints.txt) so nothing pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps bfcl-eval   # its declared dependencies pull torch/CUDA; the data needs none
	touch $(STAMP)

# The drafter's C kernels (ngram/_speedups.c) are built by the editable install; rebuilt when edited.
$(SPEEDUPS): ngram/_speedups.c $(STAMP)
	$(PIP) install -q --no-deps -e .
	touch $(SPEEDUPS)

test: $(SPEEDUPS)
	$(PY) -m pytest -q

test-fast: $(SPEEDUPS)
	$(PY) -m pytest -q -m "not slow"

# 10,000 hostile requests against a real server on the bundled model: no 5xx, memory steady (bench/fuzz.py).
fuzz: $(SPEEDUPS)
	$(PY) -m bench.fuzz --requests 10000

index: $(SPEEDUPS)
	$(PY) -m index build

serve: $(SPEEDUPS)
	@$(PY) -c "from index.sources import default_index_dir as d; import sys; sys.exit(0 if (d()/'current').exists() else 1)" \
		|| $(PY) -m index build
	$(PY) -m server --port $(PORT)

clean:
	rm -rf .venv build *.egg-info .pytest_cache

# The benchmark's peers build from source (llama.cpp takes a few minutes the first time).
BENCH_STAMP := .venv/.bench-installed
$(BENCH_STAMP): $(SPEEDUPS)
	$(PIP) install -q arctic-inference==0.3.0 numpy matplotlib
	$(PIP) install -q llama-cpp-python==0.3.36
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench

bench-quick: $(BENCH_STAMP)
	$(PY) -m bench --quick

bench-full: $(BENCH_STAMP)
	$(PY) -m bench --full
