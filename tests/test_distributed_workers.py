"""Every torchrun worker of tests/distributed leaves its gloo process group in order through
`support.distributed.joined_process_group` (barrier, then destroy; destroy at once on an
error), never by calls of its own: a worker that ends with its group alive, or tears it down
while a peer still communicates, can die of SIGABRT at interpreter exit ("terminate called
without an active exception") instead of passing or reporting its own error."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKERS = Path(__file__).resolve().parent / "distributed"
GROUP_CALLS = frozenset({"init_process_group", "destroy_process_group", "barrier"})


def group_lifetime_faults(source: str) -> list[str]:
    """What a worker does with the default process group's life that it should leave to
    `joined_process_group`: its own init/destroy/barrier calls (beyond a per-run barrier
    inside a loop), or a main block not run inside `with joined_process_group()`."""
    tree = ast.parse(source)
    faults = []
    uses_gloo = "gloo" in source or "joined_process_group" in source
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in GROUP_CALLS:
            in_loop = any(isinstance(loop, (ast.For, ast.While)) and node in ast.walk(loop)
                          for loop in ast.walk(tree))
            if not (node.func.attr == "barrier" and in_loop):
                faults.append(f"line {node.lineno}: dist.{node.func.attr}()")
    main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    joined = any(isinstance(n, ast.With) and "joined_process_group" in ast.unparse(n.items[0])
                 for block in main for n in block.body)
    if uses_gloo and not joined:
        faults.append("its main block does not run inside `with joined_process_group()`")
    return faults


TORCHRUN_WORKERS = sorted(p.name for p in WORKERS.glob("*_worker.py")
                          if "FakeStore" not in p.read_text())
"""The workers with a real process group (the others use torch's in-process `fake` one)."""


def test_the_torchrun_workers_include_the_four_cpu_workers():
    assert {"dtensor_worker.py", "executor_worker.py", "recipe_worker.py",
            "topology_worker.py"} <= set(TORCHRUN_WORKERS)


@pytest.mark.parametrize("worker", TORCHRUN_WORKERS)
def test_a_torchrun_worker_leaves_its_process_group_through_joined_process_group(worker):
    assert group_lifetime_faults((WORKERS / worker).read_text()) == []


def test_the_check_finds_a_worker_that_manages_its_group_itself():
    worker = ("import torch.distributed as dist\n"
              "def main():\n"
              "    dist.init_process_group('gloo')\n"
              "    for run in range(2):\n"
              "        dist.barrier()\n"
              "    dist.barrier()\n"
              "    dist.destroy_process_group()\n"
              "if __name__ == '__main__':\n"
              "    main()\n")
    assert group_lifetime_faults(worker) == [
        "line 3: dist.init_process_group()", "line 6: dist.barrier()",
        "line 7: dist.destroy_process_group()",
        "its main block does not run inside `with joined_process_group()`"]
