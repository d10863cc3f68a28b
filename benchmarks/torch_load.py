"""Measure a tensor-parallel transformers model filled by partc against transformers' own loader.

Runs against the installed partc (`pip install .` or `pip install -e .`), torch, transformers and
accelerate. Writes the synthetic bf16 Llama checkpoint of benchmarks/load.py (the 777.6 MiB
`reference` preset of BENCHMARKS.md by default), compiles the built-in `llama` family at T=2
(PP=1), then launches `torchrun --nproc_per_node=T` (gloo, CPU) once per contender and repeat,
interleaved (the order alternates every repeat), each launch fresh processes with the page cache
warmed first:

- partc: the recipe of docs/transformers_tp.md: the transformers model built with its tp_plan
  on meta parameters (accelerate's init_empty_weights), then `load(zero_copy="private")` of the
  generated package (copy-on-write views of the file where a slice is one byte run, copies
  otherwise), `to_dtensors`, and the shards assigned to the DTensor/parameter slots;
- transformers: `AutoModelForCausalLM.from_pretrained(checkpoint, tp_plan="auto")`.

The checkpoint is evicted from the page cache and read once before the launches, with
readahead (`--page-cache large`, the default: 2 MiB folios) or without (`small`: 4 KiB pages),
as benchmarks/load.py does; both contenders map the file, and a mapping's first touches cost
~10-30x less per page in the large state. The generated package is byte-compiled before the
launches, as transformers' modules were
when pip installed them. Every rank reports, in seconds from its own process start
(/proc/self/stat):

- imports: torch, transformers, accelerate (and partc's runtime and the generated package);
- setup: `init_process_group` and the TP DeviceMesh;
- construction: the model's modules and transformers' TP layout, no weights;
- weights: reading the rank's share into the parameter slots (transformers: from the start of
  its `_load_pretrained_model` to the end of its `_finalize_model_loading`, timed by wrapping
  them; construction is the rest of `from_pretrained`);
- first touch: one byte read from every 4 KiB page of every parameter (transformers may return
  views of the mapped checkpoint whose pages are read only then); weights resident = weights +
  first touch, the figure the weight-loading target is about;
- ready: process start to the model ready with its weights in memory (then a one-token forward
  checks that it runs);
- peak RSS: the rank's VmHWM;
- floor: the least work any loader returning contiguous parameters does for a rank, the T
  ranks at once (released together by a barrier): the one-run slices mapped copy-on-write and
  touched once a page, the column slices copied with numpy into fresh pages faulted in first;
  no framework, no checks. transformers' weights resident over it is the most any such loader
  could reach against transformers in the same run.

The figures are medians over the repeats of the slowest rank (the job waits for it). The ratios
printed are transformers over partc; the targets are weight loading >= 2x and process start ->
ready >= 1x (partc no slower). Usage:

    python benchmarks/torch_load.py                      # 777.6 MiB, T=2, median of 3
    python benchmarks/torch_load.py --preset small --repeats 5 --dir /tmp/ckpt
    python benchmarks/torch_load.py --page-cache small   # the checkpoint cached in 4 KiB pages
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/load.py: the synthetic checkpoint

from load import (  # noqa: E402
    PAGE_CACHE_STATES,
    PRESETS,
    checkpoint_files,
    huge_mapped,
    llama_config,
    settle,
    warm,
    write_checkpoint,
)

WORKER = r'''
import json, os, sys, time

def since_start():
    """Seconds since this process started (its /proc starttime, in clock ticks since boot)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start

def vm(key):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(key)).split()[1]) * 1024

mode, spec = sys.argv[1], json.loads(sys.argv[2])
marks = {"started": since_start()}
import torch
import torch.distributed as dist
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
if mode == "partc":
    import importlib
    sys.path.insert(0, spec["build"])
    loaders = importlib.import_module(spec["package"])
    sys.path.insert(0, spec["recipe_dir"])
    from transformers_tp import tp_model_from_partc
    from partc.runtime.mesh import BuildTopology
marks["imports"] = since_start()
dist.init_process_group("gloo")
if mode == "partc":
    mesh = BuildTopology(tensor_parallel_size=spec["tp"], pipeline_parallel_size=1
                         ).device_mesh("cpu")["tp"]
marks["setup"] = since_start()
transformers.logging.set_verbosity_error()
weights = {}
if mode == "partc":
    import transformers_tp as recipe
    real_load = loaders.load
    def timed_load(*args, **kwargs):
        marks["construction"] = since_start()  # the recipe loads right after building
        try:
            return real_load(*args, **kwargs)
        finally:
            marks["loaded"] = since_start()  # then to_dtensors and filling the slots
    loaders.load = timed_load
    model = tp_model_from_partc(loaders, spec["checkpoint"], mesh, dtype=torch.bfloat16)
    marks["weights"] = since_start()
else:
    # weights: from _load_pretrained_model's start to _finalize_model_loading's end (both
    # static methods, called one after the other by from_pretrained)
    cls = transformers.PreTrainedModel
    load, finalize = cls._load_pretrained_model, cls._finalize_model_loading
    def timed_load(*args, **kwargs):
        weights["start"] = since_start()
        return load(*args, **kwargs)
    def timed_finalize(*args, **kwargs):
        try:
            return finalize(*args, **kwargs)
        finally:
            weights["end"] = since_start()
    cls._load_pretrained_model = staticmethod(timed_load)
    cls._finalize_model_loading = staticmethod(timed_finalize)
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], tp_plan="auto",
                                                 dtype=torch.bfloat16)
    model.train(False)
    end = since_start()
    # construction is from_pretrained without its weight loading
    marks["construction"] = marks["setup"] + (weights["start"] - marks["setup"]) \
        + (end - weights["end"])
    marks["weights"] = marks["construction"] + (weights["end"] - weights["start"])
marks["returned"] = since_start()
# read one byte of every 4 KiB page of every parameter: transformers' tensors may still be
# views of the mapped checkpoint, whose pages are read only when first touched
total = 0
for p in model.parameters():
    local = p.to_local() if hasattr(p, "to_local") else p
    flat = local.detach().reshape(-1).view(torch.uint8)
    total += int(flat[::4096].sum())
marks["ready"] = since_start()
with torch.no_grad():  # the model runs: one token
    out = model(torch.tensor([[1]])).logits
assert out.shape[-1] == spec["vocab"] and bool(torch.isfinite(out.float()).all())
nbytes = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes
             for p in model.parameters())
result = {"rank": dist.get_rank(), "marks": marks, "hwm": vm("VmHWM"), "nbytes": nbytes}
with open(os.path.join(spec["reports"], f"{mode}-rank-{dist.get_rank()}.json"), "w") as f:
    f.write(json.dumps(result))
dist.barrier()
dist.destroy_process_group()
'''

FLOOR_WORKER = r'''
import json, mmap, os, struct, sys, time
import numpy as np
import torch.distributed as dist

# The least work a loader returning contiguous parameters does for this rank, with the ranks
# of the node doing it at once: the tensors whose local slice is one byte run of the file are
# views of a copy-on-write mapping of it, touched once a page (as the recipe's shards are); the
# others (column slices) are copied with numpy from that mapping into fresh memory faulted in
# first. No checks, no framework, no threads: data movement and page faults only.
spec = json.loads(sys.argv[2])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
path = os.path.join(spec["checkpoint"], "model.safetensors")
with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
base = 8 + n
whole = np.frombuffer(mapping, np.uint8)
import ctypes
madvise = ctypes.CDLL(None, use_errno=True).madvise
madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
dist.barrier()
t0 = time.monotonic()
total, kept = 0, []
for name, axis, ranges in spec["selections"][rank]:
    entry = header[name]
    begin, end = entry["data_offsets"]
    shape = entry["shape"]
    data = whole[base + begin:base + end]
    assert len(ranges) <= 1, (name, ranges)
    if axis is None or axis == 0:
        lo, hi = ranges[0] if axis is not None else (0, shape[0])
        row = (end - begin) // max(1, shape[0])
        view = data[lo * row:hi * row]
        total += int(view[::4096].sum())
        kept.append(view)
    else:
        (lo, hi), = ranges
        item = (end - begin) // (shape[0] * shape[1])
        rows = data.reshape(shape[0], shape[1] * item)
        memory = mmap.mmap(-1, shape[0] * (hi - lo) * item,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        out = np.frombuffer(memory, np.uint8).reshape(shape[0], (hi - lo) * item)
        madvise(out.ctypes.data, out.nbytes, 23)  # MADV_POPULATE_WRITE, as partc's readers do
        out[:] = rows[:, lo * item:hi * item]
        kept.append(out)
seconds = time.monotonic() - t0
nbytes = sum(a.nbytes for a in kept)
with open(os.path.join(spec["reports"], f"floor-rank-{rank}.json"), "w") as f:
    f.write(json.dumps({"rank": rank, "seconds": seconds, "nbytes": nbytes}))
dist.barrier()
dist.destroy_process_group()
'''

PHASES = ("imports", "setup", "construction", "weights", "touch")


def recipe_module(folder: Path) -> Path:
    """Write the recipe module of docs/transformers_tp.md (its first python block)."""
    import re

    doc = HERE.parent / "docs" / "transformers_tp.md"
    if not doc.is_file():  # an installed partc ships its docs as package data
        import partc.docs

        doc = Path(partc.docs.__file__).parent / "transformers_tp.md"
    block = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)[0]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "transformers_tp.py").write_text(block)
    return folder


def launch(mode: str, spec: dict[str, Any], tp: int, reports: Path) -> list[dict[str, Any]]:
    """One torchrun launch of T fresh processes; each rank's report."""
    for old in reports.glob(f"{mode}-rank-*.json"):
        old.unlink()
    script = reports / ("floor.py" if mode == "floor" else "worker.py")
    script.write_text(FLOOR_WORKER if mode == "floor" else WORKER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "PYTHONDONTWRITEBYTECODE")}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script), mode,
         json.dumps({**spec, "reports": str(reports)})],
        capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{mode} launch failed:\n{done.stderr[-4000:]}")
    return [json.loads((reports / f"{mode}-rank-{r}.json").read_text()) for r in range(tp)]


def phase_seconds(report: dict[str, Any]) -> dict[str, float]:
    """Each phase's own seconds, and ready (process start to ready)."""
    marks = report["marks"]
    out, previous = {}, 0.0
    for phase in PHASES[:-1]:
        out[phase] = marks[phase] - previous
        previous = marks[phase]
    out["touch"] = marks["ready"] - marks["returned"]
    out["resident"] = out["weights"] + out["touch"]
    out["ready"] = marks["ready"]
    return out


def main() -> None:
    try:
        import partc
    except ImportError:
        raise SystemExit("benchmarks/torch_load.py measures the installed partc: run "
                         "`pip install .` (or `pip install -e .`) in the clone first") from None
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="reference")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="checkpoint folder (kept; reused if present)")
    parser.add_argument("--page-cache", choices=PAGE_CACHE_STATES, default="large",
                        help="how the checkpoint is cached for the launches: large (read with "
                             "readahead: 2 MiB folios) or small (4 KiB pages); see "
                             "benchmarks/load.py")
    args = parser.parse_args()
    hidden, intermediate, heads, kv, vocab, layers = PRESETS[args.preset]
    config = llama_config(hidden, intermediate, heads, kv, vocab, args.layers or layers)
    scratch = tempfile.TemporaryDirectory(prefix="partc-torch-bench-")
    root = Path(scratch.name)
    folder = args.dir or root / "checkpoint"
    existing = folder / "config.json"
    if not existing.is_file() or json.loads(existing.read_text()) != config:
        print(f"writing the synthetic checkpoint to {folder} ...", flush=True)
        write_checkpoint(folder, config, 1)
    files = checkpoint_files(folder)
    total = sum(f.stat().st_size for f in files)

    from partc.api import CompileOptions, compile_family
    from partc.emit.render import package_name
    from partc.plan.topology import Topology

    result = compile_family("llama", folder / "config.json",
                            Topology(tensor_parallel_size=args.tp, pipeline_parallel_size=1),
                            CompileOptions(checkpoint=folder, out=root / "build"))
    # the generated package byte-compiled once, as transformers' modules were when installed:
    # a serving process imports compiled code (where PYTHONDONTWRITEBYTECODE is set, or the
    # build is read-only, nothing else would write it; compiling the rank module from source
    # measured ~7 ms of the weights phase)
    import compileall

    if not compileall.compile_dir(str(root / "build"), quiet=1):
        raise SystemExit("could not byte-compile the generated package")
    share = result.plan.ranks[0].info.local_parameter_bytes
    selections = [[[t.target, t.selection[0], [list(r) for r in t.selection[1]]]
                   for t in rank.layout.tensors] for rank in result.plan.ranks]
    spec = {"build": str(root / "build"), "package": package_name(result.plan),
            "recipe_dir": str(recipe_module(root / "recipe")), "checkpoint": str(folder),
            "tp": args.tp, "vocab": config["vocab_size"], "selections": selections}
    reports = root / "reports"
    reports.mkdir()
    import torch
    import transformers

    print(f"partc {partc.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; checkpoint {total / 2**20:.1f} MiB, rank 0's share "
          f"{share / 2**20:.1f} MiB at T={args.tp}; {os.cpu_count()} CPUs; median of "
          f"{args.repeats} launches each, interleaved", flush=True)
    cache = args.page_cache
    huge_before = settle(files, cache)
    load_before = os.getloadavg()
    modes = ["partc", "transformers"]
    for mode in modes:  # one untimed launch each: bytecode caches, the page cache of the libs
        warm(files, cache)
        launch(mode, spec, args.tp, reports)
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
    floors: list[float] = []
    for repeat in range(args.repeats):
        for mode in (modes if repeat % 2 == 0 else modes[::-1]):
            warm(files, cache)
            runs[mode].append(launch(mode, spec, args.tp, reports))
        warm(files, cache)
        floors.append(max(r["seconds"] for r in launch("floor", spec, args.tp, reports)))
    load_after = os.getloadavg()
    huge_after = huge_mapped(files)

    def slowest(mode: str, key: str) -> float:
        """Median over launches of the slowest rank's figure."""
        return statistics.median(max(phase_seconds(r)[key] for r in launch_reports)
                                 for launch_reports in runs[mode])

    def peak(mode: str, rank: int) -> float:
        return statistics.median(launch_reports[rank]["hwm"] for launch_reports in runs[mode])

    print(f"load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {', '.join(f'{x:.2f}' for x in load_after)}")
    print(f"page cache {cache} (the checkpoint evicted, then read once "
          f"{'with readahead' if cache == 'large' else 'with POSIX_FADV_RANDOM'}): "
          f"{huge_before:.0%} of it mapped in 2 MiB entries before the launches, "
          f"{huge_after:.0%} after")
    keys = [*PHASES, "resident", "ready"]
    labels = {"imports": "imports s", "setup": "dist setup s", "construction": "construct s",
              "weights": "weights returned s", "touch": "first touch s",
              "resident": "weights resident s", "ready": "start->ready s"}
    print("\n| contender | " + " | ".join(labels[k] for k in keys) + " | "
          + " | ".join(f"peak RSS r{r} MiB" for r in range(args.tp)) + " |")
    print("|---|" + "---:|" * (len(keys) + args.tp))
    for mode in modes:
        cells = [f"{slowest(mode, k):.3f}" for k in keys]
        cells += [f"{peak(mode, r) / 2**20:.0f}" for r in range(args.tp)]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    load_call = statistics.median(max(r["marks"]["loaded"] - r["marks"]["construction"]
                                      for r in launch_reports) for launch_reports in runs["partc"])
    print(f"\npartc's weights: the generated load() {load_call:.3f} s, the rest to_dtensors and "
          "filling the slots")
    loaded = {m: runs[m][0][0]["nbytes"] for m in modes}
    if loaded["partc"] != loaded["transformers"]:
        raise SystemExit(f"rank 0 holds {loaded['partc']} bytes of parameters with partc, "
                         f"{loaded['transformers']} with transformers")
    weights = slowest("transformers", "resident") / slowest("partc", "resident")
    returned = slowest("transformers", "weights") / slowest("partc", "weights")
    ready = slowest("transformers", "ready") / slowest("partc", "ready")
    construct = slowest("transformers", "construction") / slowest("partc", "construction")
    floor = statistics.median(floors)
    print(f"\nrank 0 parameters: {loaded['partc'] / 2**20:.1f} MiB in both")
    print(f"floor: the ranks at once, each mapping its one-run slices copy-on-write and "
          f"touching them, and copying its column slices with numpy into fresh pages: slowest "
          f"rank {floor:.3f} s (median of {len(floors)}); partc's weights resident / floor "
          f"{slowest('partc', 'resident') / floor:.2f}, transformers' / floor "
          f"{slowest('transformers', 'resident') / floor:.2f} (the most any loader returning "
          "contiguous parameters could reach against transformers here)")
    # three decimals where a target is judged: 1.996 is not shown as a missed "2.00"
    print(f"ratios, transformers / partc: weight loading (resident) {weights:.3f}x (target >= 2: "
          f"{'ok' if weights >= 2 else 'MISSED'}), process start -> ready {ready:.3f}x "
          f"(target >= 1: {'ok' if ready >= 1 else 'MISSED'}), construction {construct:.2f}x, "
          f"weights returned (pages not yet read) {returned:.2f}x")
    scratch.cleanup()


if __name__ == "__main__":
    main()
