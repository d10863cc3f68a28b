"""Run under torchrun with CUDA: the transformers TP recipe of docs/transformers_tp.md on a CUDA
mesh with NCCL, each rank on its own GPU (cuda:LOCAL_RANK). Several ranks on one GPU through
gloo is no option: gloo's CUDA all_gather (the lm_head's gathered output) crashed with SIGSEGV
under torch 2.11 (docs/performance.md).

argv: the recipe module (written to a file by the test), the build folder, the generated package,
the checkpoint, the model dtype. Writes `rank-<g>.npz` (logits, as float32) and `rank-<g>.json`
(the devices and dtypes of the parameters) to PARTC_TEST_REPORTS."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.distributed import joined_process_group  # noqa: E402


def main(recipe_file: str, build: str, package_name: str, checkpoint: str, dtype: str,
         device: torch.device) -> None:
    spec = importlib.util.spec_from_file_location("transformers_tp_recipe", recipe_file)
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    sys.path.insert(0, build)
    loaders = importlib.import_module(package_name)
    mesh = loaders.device_mesh("cuda")["tp"]
    model = recipe.tp_model_from_partc(loaders, checkpoint, mesh, attn_implementation="eager",
                                       dtype=getattr(torch, dtype))
    with np.load(Path(checkpoint) / "reference.npz") as npz:
        input_ids = torch.from_numpy(npz["input_ids"].astype(np.int64)).to(device)
    with torch.no_grad():
        logits = model(input_ids).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    devices, dtypes = set(), set()
    for _, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        devices.add(str(local.device))
        dtypes.add(str(local.dtype))
    me = dist.get_rank()
    reports = Path(os.environ["PARTC_TEST_REPORTS"])
    np.savez(reports / f"rank-{me}.npz", logits=logits.float().cpu().numpy())
    (reports / f"rank-{me}.json").write_text(json.dumps(
        {"rank": me, "devices": sorted(devices), "dtypes": sorted(dtypes)}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # one GPU per rank (NCCL)
    torch.cuda.set_device(device)
    with joined_process_group("nccl"):
        main(*sys.argv[1:6], device)
