#!/usr/bin/env bash
# The oldest releases the extras accept (pyproject.toml), installed into a throwaway virtual
# environment outside the repository, and the torch and verify tests run against them:
#   scripts/check_oldest_deps.sh [VENV]        (default /tmp/partc-oldest-venv)
# torch 2.6.0 is a CUDA wheel from PyPI (about 0.8 GB, plus 2.9 GB of nvidia-*-cu12 libraries
# it pins); the tests run on the CPU. TORCH=, TRANSFORMERS=, ACCELERATE=, HUB= override the
# versions. Exit status: pytest's.
# Measured (2 cores): torch 2.6.0 + transformers 5.0.0 + accelerate 1.2.0: test_dtensor,
# test_torch_distributed, test_device, test_split_chunk 67 passed, test_verify 42 passed.
# Not at these versions: the docs/transformers_tp.md recipe (CHECK_RECIPE=1 adds its test),
# which needs transformers' own TP API (apply_tensor_parallelism(model, mesh, plan), 5.23+)
# and then a torch whose distribute_tensor takes src_data_rank (2.6.0 does not): with
# TORCH=2.7.0 TRANSFORMERS=5.23.0 CHECK_RECIPE=1, tests/test_transformers_tp.py gave 8 passed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/partc-oldest-venv}
torch=${TORCH:-2.6.0}
transformers=${TRANSFORMERS:-5.0.0}
accelerate=${ACCELERATE:-1.2.0}
hub=${HUB:-0.26.0}
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git archive HEAD | tar -x -C "$src"   # the committed tree, not whatever is being edited
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "$src[test]" "torch==$torch" "transformers==$transformers" \
    "accelerate==$accelerate"
"$venv/bin/pip" list 2>/dev/null | grep -Ei '^(torch|transformers|accelerate|huggingface.hub) '
# huggingface_hub: the oldest accepted, in a venv of its own (transformers 5 needs >= 1.3)
python3 -m venv "$venv-hub"
"$venv-hub/bin/pip" install --quiet "huggingface_hub==$hub"
"$venv-hub/bin/python" - <<'PY'
"""snapshot_download(local_files_only=True), scan_cache_dir and the names partc's lookup
imports, against a hand-made cache."""
import os
import pathlib
import tempfile

cache = pathlib.Path(tempfile.mkdtemp())
os.environ["HF_HUB_CACHE"] = str(cache)
repo = cache / "models--org--tiny"
snapshot = repo / "snapshots" / ("a" * 40)
blob = repo / "blobs" / "b1"
blob.parent.mkdir(parents=True)
snapshot.mkdir(parents=True)
blob.write_text("{}")
(snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
(repo / "refs").mkdir()
(repo / "refs" / "main").write_text("a" * 40)

import huggingface_hub
from huggingface_hub import constants, scan_cache_dir, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

assert constants.HF_HUB_CACHE == str(cache)
assert snapshot_download("org/tiny", local_files_only=True) == str(snapshot)
assert [r.repo_id for r in scan_cache_dir().repos] == ["org/tiny"]
try:
    snapshot_download("org/missing", local_files_only=True)
except LocalEntryNotFoundError:
    print(f"huggingface_hub {huggingface_hub.__version__}: ok")
else:
    raise SystemExit("a missing repo was not refused")
PY
rm -rf "$venv-hub"
cd "$src"
"$venv/bin/python" -m pytest -q -n 0 -p no:cacheprovider tests/test_dtensor.py \
    tests/test_torch_distributed.py tests/test_device.py tests/test_split_chunk.py \
    tests/test_verify.py ${CHECK_RECIPE:+tests/test_transformers_tp.py}
