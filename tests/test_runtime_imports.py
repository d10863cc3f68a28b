"""What importing the runtime loads: ml_dtypes, concurrent.futures and hashlib (OpenSSL) only
when needed, never pathlib, and none of the pipeline, device, topology or expert modules a
plain numpy load never calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

import partc

from support import QUANTIZED, compile_and_import, hf

PROBE = r"""
import json, sys
build, package, checkpoint, bf16 = sys.argv[1:5]
found = {}
import partc.runtime
HEAVY = ("ml_dtypes", "concurrent.futures", "hashlib", "_hashlib")
found["runtime"] = sorted(m for m in HEAVY if m in sys.modules)
PATHS = ("pathlib",)
found["paths"] = sorted(m for m in PATHS if m in sys.modules)
LATE = ("partc.partition.boundary", "partc.partition.pipeline", "partc.runtime.boundary_codec",
        "partc.runtime.driver",
        "partc.runtime.device", "partc.runtime.mesh", "partc.parallel.experts", "difflib",
        "partc.parallel.layout", "partc.parallel.shape")
found["late"] = sorted(m for m in LATE if m in sys.modules)
sys.path.insert(0, build)
import importlib
module = importlib.import_module(package)
state = module.load(checkpoint, rank=0)
found["late after load"] = sorted(m for m in LATE if m in sys.modules)
found["layout"] = [[t.target, list(t.local_shape), t.placement.to_json(),
                    list(state.tensors[t.target].shape)] for t in state.layout.tensors]
found["info"] = [state.info.owned_tensors, state.info.local_parameter_bytes,
                 sum(a.nbytes for a in state.tensors.values())]
found["late after layout"] = sorted(m for m in LATE if m in sys.modules)
module.rank_module(0).boundary()
found["late after boundary"] = sorted(m for m in LATE if m in sys.modules)
module.topology()
found["late after topology"] = sorted(m for m in LATE if m in sys.modules)
found["f32 load"] = sorted(m for m in HEAVY if m in sys.modules)
found["paths after load"] = sorted(m for m in PATHS if m in sys.modules)
found["dtypes"] = sorted({str(a.dtype) for a in state.tensors.values()})
from partc.runtime.checkpoint import open_checkpoint
from partc.runtime._engine.reader import read_tensor
array = read_tensor(open_checkpoint(bf16), "w")
found["bf16"] = [str(array.dtype), "ml_dtypes" in sys.modules, array.view("u2").tolist()]
print(json.dumps(found))
"""


def test_the_runtime_imports_ml_dtypes_only_for_a_bf16_or_fp8_tensor(tmp_path: Path) -> None:
    out = tmp_path / "build"
    plan, _ = compile_and_import("llama", hf("llama") / "config.json", out, tp=2, pp=1,
                                 checkpoint=hf("llama"))
    package = next(p.name for p in out.iterdir() if (p / "__init__.py").is_file())
    bits = np.array([0x3F80, 0xC000, 0x0000], dtype=np.uint16)
    save_file({"w": bits.view(ml_dtypes.bfloat16)}, str(tmp_path / "bf16.safetensors"))
    # without site (-S): an editable install's import finder, run from a .pth file at start-up,
    # imports pathlib itself; the probe sees only partc, numpy and ml_dtypes on its path
    roots = {str(Path(m.__file__).parent.parent) for m in (partc, np, ml_dtypes)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sorted(roots))}
    run = subprocess.run([sys.executable, "-S", "-c", PROBE, str(out), package,
                          str(hf("llama")), str(tmp_path / "bf16.safetensors")],
                         capture_output=True, text=True, check=False, env=env)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["runtime"] == [], "importing partc.runtime loads none of them"
    assert found["dtypes"] == ["float32"], "the llama fixture is an F32 checkpoint"
    assert found["f32 load"] == [], "a generated module's F32 load needs none of them"
    assert found["paths"] == [], "importing partc.runtime does not import pathlib (issue 18)"
    assert found["paths after load"] == [], "a plain numpy load never imports pathlib"
    assert found["bf16"] == ["bfloat16", True, [0x3F80, 0xC000, 0x0000]]
    assert found["late"] == [] and found["late after load"] == []
    # a load reads by the tables' selections; the layout classes are built on first use
    assert found["late after layout"] == ["partc.parallel.layout"]
    compiled = plan.ranks[0]  # the compiler's own layout of rank 0, against the decoded one
    assert found["layout"] == [[t.target, list(t.local_shape), t.placement.to_json(),
                                list(t.local_shape)] for t in compiled.layout.tensors]
    assert found["info"] == [compiled.info.owned_tensors, compiled.info.local_parameter_bytes,
                             compiled.info.local_parameter_bytes]
    assert found["late after boundary"] == ["partc.parallel.layout", "partc.partition.boundary",
                                            "partc.runtime.boundary_codec"]
    assert found["late after topology"] == ["partc.parallel.layout", "partc.parallel.shape",
                                            "partc.partition.boundary",
                                            "partc.runtime.boundary_codec", "partc.runtime.mesh"]


def test_the_header_hash_equals_hashlibs_sha256() -> None:
    # headers and tensor lists are hashed without importing hashlib: the same digests
    import hashlib
    import os

    from partc.runtime.checkpoint import open_checkpoint
    from partc.runtime.files import sha256

    for size in (0, 1, 63, 64, 65, 4096, 1 << 20):
        data = os.urandom(size)
        assert sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
    parts = sha256(b"partc")
    parts.update(b" header")
    assert parts.hexdigest() == hashlib.sha256(b"partc header").hexdigest()
    path = hf("llama") / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert open_checkpoint(path).files[0].digest == hashlib.sha256(raw[8:8 + n]).hexdigest()


TORCH_PROBE = r"""
import json, sys
build, package, checkpoint = sys.argv[1:4]
sys.path.insert(0, build)
import importlib
import torch
module = importlib.import_module(package)
found = {"before": "ml_dtypes" in sys.modules}
tensors = {}
for rank in range(module.WORLD_SIZE):
    for zero_copy in (False, "private"):
        state = module.load(checkpoint, rank=rank, framework="torch", zero_copy=zero_copy)
        tensors[f"{rank} {zero_copy}"] = {name: [str(t.dtype), t.view(torch.uint8).reshape(-1)
                                                 .tolist()[:4096]]
                                          for name, t in state.tensors.items()}
found["after"] = "ml_dtypes" in sys.modules
found["tensors"] = tensors
print(json.dumps(found))
"""


def test_a_torch_load_reads_bf16_and_fp8_as_their_bits_and_never_imports_ml_dtypes(
        tmp_path: Path) -> None:
    # gpt-oss MXFP4: BF16 tensors beside U8 packed blocks and scales (which must stay uint8);
    # Qwen3 FP8: F8_E4M3 weights beside BF16 ones. The oracle is the safetensors library's
    # torch loader: same dtype, same bytes, for every slice a rank holds.
    import torch
    from safetensors.torch import load_file

    for fixture, family in (("gpt_oss_mxfp4", "gpt_oss"), ("qwen3_fp8", "qwen3")):
        folder = QUANTIZED / fixture
        out = tmp_path / fixture
        plan, _ = compile_and_import(family, folder / "config.json", out, tp=2, pp=1,
                                     checkpoint=folder)
        package = next(p.name for p in out.iterdir() if (p / "__init__.py").is_file())
        run = subprocess.run([sys.executable, "-c", TORCH_PROBE, str(out), package, str(folder)],
                             capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stderr
        found = json.loads(run.stdout.strip().splitlines()[-1])
        assert found["before"] is False and found["after"] is False, fixture
        whole = load_file(str(folder / "model.safetensors"))
        kinds = {str(t.dtype) for t in whole.values()}
        assert "torch.bfloat16" in kinds and kinds & {"torch.uint8", "torch.float8_e4m3fn"}
        for rank in plan.ranks:
            for zero_copy in (False, "private"):
                got = found["tensors"][f"{rank.rank} {zero_copy}"]
                assert set(got) == {t.target for t in rank.layout.tensors}
                for item in rank.layout.tensors:
                    want = whole[item.target]
                    axis, ranges = item.placement.selection(tuple(want.shape))
                    if axis is not None:
                        want = torch.cat([want.narrow(axis, lo, hi - lo)
                                          for lo, hi in ranges], dim=axis)
                    dtype, head = got[item.target]
                    assert dtype == str(want.dtype), (fixture, item.target)
                    assert head == want.contiguous().view(torch.uint8).reshape(-1).tolist()[
                        :4096], (fixture, rank.rank, item.target)
