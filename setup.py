"""The drafter's C kernels (ngram/_speedups.c), declared here because setuptools supports C extensions
in setup.py without warnings (its pyproject.toml table is still experimental). Everything else about the
package is in pyproject.toml. Optional: without a compiler the install still succeeds and ngram falls back
to its pure-Python twins (same drafts, slower proposals)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ngram._speedups", ["ngram/_speedups.c"], optional=True,
                             extra_compile_args=["-O2"])])
