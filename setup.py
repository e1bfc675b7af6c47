"""The C kernels, declared here because setuptools supports C extensions in setup.py without warnings
(its pyproject.toml table is still experimental): the drafter's (ngram/_speedups.c) and the CPU path's
int8 matmul and attention (server/_cpu_*.c: portable -O3; their AVX2 functions are compiled for
AVX2 one by one and picked at run time, so no global -mavx2). Everything else about the package is in
pyproject.toml. Optional: without a compiler the install still succeeds and ngram falls back to its
pure-Python twins (same drafts, slower proposals)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ngram._speedups", ["ngram/_speedups.c"], optional=True,
                             extra_compile_args=["-O2"]),
                   Extension("server._cpu_kernels",
                             ["server/_cpu_kernels.c", "server/_cpu_pool.c", "server/_cpu_args.c",
                              "server/_cpu_matmul.c", "server/_cpu_attention.c", "server/_cpu_elementwise.c"],
                             depends=["server/_cpu_kernels.h"], optional=True,
                             extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"],
                             libraries=["m"])])
