"""Run under torchrun: the transformers TP recipe of docs/transformers_tp.md, filled from partc.

argv: the recipe module (the doc's first python block, written to a file by the test), the
build folder, the generated package, the checkpoint. Each process builds the transformers model
with its tp_plan on partc's TP mesh, fills it from its own rank's shards, runs the reference
input and writes `rank-<g>.npz` (logits) and `rank-<g>.json` (what its parameters hold) to
PARTC_TEST_REPORTS; a parameter is "mapped" when its memory lies in a mapping of the
checkpoint file (a zero-copy view).
"""

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
from support import file_mappings  # noqa: E402
from support.distributed import joined_process_group  # noqa: E402


def main() -> None:
    recipe_file, build, package_name, checkpoint = sys.argv[1:5]
    spec = importlib.util.spec_from_file_location("transformers_tp_recipe", recipe_file)
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    sys.path.insert(0, build)
    loaders = importlib.import_module(package_name)
    mesh = loaders.device_mesh("cpu")["tp"]
    model = recipe.tp_model_from_partc(loaders, checkpoint, mesh, attn_implementation="eager")
    training = sorted(name for name, module in model.named_modules() if module.training)
    with np.load(Path(checkpoint) / "reference.npz") as npz:
        input_ids = torch.from_numpy(npz["input_ids"].astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids).logits
    regions = file_mappings(Path(checkpoint) / "model.safetensors")
    params = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        start = local.data_ptr()
        params[name] = {"dtensor": isinstance(param, DTensor), "local": list(local.shape),
                        "dtype": str(local.dtype),
                        "global": list(param.shape), "meta": bool(local.is_meta),
                        "contiguous": local.is_contiguous(),
                        "mapped": any(a <= start and start + local.nbytes <= b
                                      for a, b, _ in regions)}
    me = dist.get_rank()
    reports = Path(os.environ["PARTC_TEST_REPORTS"])
    np.savez(reports / f"rank-{me}.npz", logits=logits.numpy())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    (reports / f"rank-{me}.json").write_text(json.dumps({"rank": me, "params": params,
                                                         "tied": tied, "training": training}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    with joined_process_group():
        main()
