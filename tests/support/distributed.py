"""The life of a torchrun worker's default process group, in one place, for every gloo worker of
tests/distributed.

A gloo process group owns C++ threads (the pairs' event loop, the work queue) that can still be
running when the interpreter shuts down if a process exits with its group alive: one that
raised, or one that left while a peer was still mid-collective. A thread that then needs the
GIL during interpreter finalization is ended by it, which inside C++ is `std::terminate`
("terminate called without an active exception", SIGABRT) instead of the rank's own error or
exit 0. So every worker runs its body inside `joined_process_group`:

- the body is a function, so its DTensors, meshes and groups are released when it returns,
  and `gc.collect()` frees any left in reference cycles while the interpreter is whole;
- on success every rank waits at a barrier before any tears its pairs down (no rank closes its
  sockets while a peer still reads from them), then destroys the group;
- on failure the group is destroyed at once, without a barrier (a peer may be gone), and the
  error propagates: torchrun then reports this rank's traceback and stops the others.

The group's timeout is short (`GROUP_TIMEOUT`), so that a rank blocked on a peer that died
fails by itself instead of outliving the test that launched it (the test's subprocess timeout
kills torchrun, not its workers).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

GROUP_TIMEOUT = timedelta(seconds=120)
"""How long a collective waits for its peers before it fails (gloo's default is 30 minutes)."""


@contextmanager
def joined_process_group(backend: str = "gloo") -> Iterator[None]:
    """Initialise the default process group from torchrun's environment, and leave it in
    order: all ranks at a barrier, then destroyed; on an error destroyed at once."""
    dist.init_process_group(backend, timeout=GROUP_TIMEOUT)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()  # no barrier: the peers may be gone or elsewhere
        raise
    gc.collect()  # DTensors and meshes in reference cycles, freed while Python is whole
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def torchrun(worker: Path, runs: list[dict[str, Any]], folder: Path, processes: int = 4
             ) -> Path:
    """Launch `worker` on `processes` CPU processes under torchrun with `runs` (written to
    `folder/runs.json`, its argument); returns the folder the workers reported into
    (PARTC_TEST_REPORTS). A free rendezvous port, one thread per process; fails with the
    workers' stderr when torchrun does."""
    spec = folder / "runs.json"
    spec.write_text(json.dumps(runs))
    reports = folder / "reports"
    reports.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(worker), str(spec)],
        capture_output=True, text=True, timeout=240,
        env={**env, "PARTC_TEST_REPORTS": str(reports), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return reports
