#!/usr/bin/env bash
# The wheels benchmarks/gpu/run.sh installs on a GPU machine that has no network: partc itself
# and the compiler's dependencies its image lacks (jsonschema and its own, shtab), and the
# transformers the tests pin (constraints.txt: the image has an older one whose tensor-parallel
# API differs), for CPython 3.12 on x86-64 Linux. Run from the repository root on a machine with pip access;
# writes .whl/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir .whl
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl .
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 shtab==1.13.0 transformers==5.24.0
ls -la .whl
