#!/usr/bin/env bash
# Here (with a package index): download what the GPU machine lacks into .whl/ (ignored by git), for
# benchmarks/gpu.sh to install offline there. The GPU image has torch, numpy, sympy, tqdm, transformers,
# pytest and hypothesis; not pulp, highspy (HiGHS, pulp[highs]) or graphviz. Python 3.12, x86-64 manylinux.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pulp==3.3.2 highspy==1.13.0 graphviz==0.21   # the versions CI resolves here (pulp 4 needs orloge, pydantic, ...)
# torchao: gpu.py's torchao row (CPUOffloadOptimizer is Python; the wheel's compiled kernels are not needed for it)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl torchao==0.18.0
ls .whl
