"""Reference torch executor (test support): serve partc's rank-local shards under torch.distributed.

Every process holds only what its generated rank module loaded. Tensor-parallel layers meet in
real collectives over the TP process group of partc's `BuildTopology`; pipeline stages hand the
boundary tensors produced by the rank module's `boundary().encode` to the next stage with
`send`/`recv`, where the next rank module's `boundary().decode` checks them. See README.md.
"""

from .model import SUPPORTED, StageResult, TensorParallel, run_stage, serve

__all__ = ["SUPPORTED", "StageResult", "TensorParallel", "run_stage", "serve"]
