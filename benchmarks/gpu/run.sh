#!/usr/bin/env bash
# The GPU check of partc, in one run on a machine with an NVIDIA GPU and no network:
# installs partc and the compiler's missing dependencies from wheels carried in .whl/ (made by
# benchmarks/gpu/wheels.sh on a machine with pip access), runs the load benchmark
# (benchmarks/gpu/bench.py), then the gpu-marked tests. Everything it finds goes to $OUT (default
# benchmarks/gpu/out): pytest.txt, results.json, table.md, nvidia-smi.txt.
#   usage: benchmarks/gpu/run.sh [all|tests|bench|quick]
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
OUT=${OUT:-benchmarks/gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/partc-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/partc-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import partc, torch, transformers, safetensors; print('partc', partc.__version__, \
'torch', torch.__version__, 'transformers', transformers.__version__, 'safetensors', \
safetensors.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"
status=0
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = quick ]; then
  extra=()
  [ "$what" = quick ] && extra=(--quick)
  python3 benchmarks/gpu/bench.py --out "$OUT" --dir /tmp/partc-gpu-bench \
    --budget "${BUDGET:-300}" "${extra[@]}" 2>&1 | tee "$OUT/bench.txt" | tail -30
fi
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -o addopts="" -m gpu -q -rA \
    tests/test_gpu.py 2>&1 | tee "$OUT/pytest.txt" | tail -40
  status=${PIPESTATUS[0]}
fi
exit "$status"
