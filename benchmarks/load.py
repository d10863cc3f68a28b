"""Measure partc's generated loaders against the read floors, warm and cold, alone and per node.

Runs against the installed partc (`pip install .`, or `pip install -e .` in a clone); it never
puts the source tree on sys.path. Writes a synthetic bf16 Llama checkpoint in Hugging Face
naming (~2 GB by default) and its config.json, compiles the built-in `llama` family for
T = 1, 2, 4, 8 (PP = 1), and measures rank 0 of each build, every figure in a fresh process,
the page cache warmed before every warm run:

- loader: the generated module's `load(checkpoint)` (time around the call);
- zero-copy: `load(checkpoint, zero_copy=True)` then one byte read from every page the
  tensors lie on (so that it pays the page faults floor (c) pays), one read per page: the pages
  are listed between the timed load and the timed touch, which is not a numpy call per tensor;
  "zero-copy pages / share pages" is how many more pages than floor (c) that is (a column
  slice's strided view lies on a page of every row of its tensor);
- floor (a): `readinto` a reused 16 MiB buffer, the rank's byte count, sequentially;
- floor (b): `readinto` one fresh `np.empty` of the rank's byte count (faults included);
- floor (c): mmap the checkpoint and read one byte of every page of the rank's byte count;
- floor (d): floor (b) the way a copying loader does it at best: the rank's byte count read in
  file order, in 8 MiB jobs taken in turn by as many threads as the loader has, each thread
  faulting in its job's fresh pages (MADV_POPULATE_WRITE) before reading into them; the
  loader's scheme on a share that is one byte run, so loader / (d) is what the share's cut
  (column slices) costs on top, and (d) / (a) what fresh destination pages cost;
- fault: MADV_POPULATE_WRITE of one fresh mapping of the rank's byte count, one thread, in
  microseconds per 4 KiB page (what every page a copying loader returns costs the kernel);
- naive (`--naive`): `safetensors.numpy.load_file` of every file, then slicing;
- cold: the checkpoint evicted from the page cache (fsync + POSIX_FADV_DONTNEED), then the
  loader; bytes fetched from storage are /proc/self/io read_bytes; "pages / share" is the least
  a page-cache read can fetch: the 4 KiB pages the rank's byte runs touch;
- warm bytes: the loader's `reader=` hook (bytes copied out of the file) over the share;
- peak RSS: the process's VmHWM minus that of a process that only did the same imports;
- whole node: all T ranks of a build loading at once (LOCAL_WORLD_SIZE=T, so each sizes its
  reader threads from the cores it shares), released together once every rank has imported
  (as a job's ranks meet at init_process_group); the slowest rank's time over rank 0's time alone
  (at least about T/cores: the node moves T shares on the same cores), over the T=1 load (the
  whole model by one process: about 1 when the ranks share the cores without loss), and, cold,
  the bytes all T ranks fetched over the union of their byte runs;
- sectors / share: the 512-byte sectors the rank's byte runs touch (the least any read from
  this disk fetches; O_DIRECT reads of column runs fetch these);
- import: `import partc.runtime` against `import numpy`, each in a fresh interpreter that
  imported nothing before it, alternating; the median of the pairs' differences and the best
  against the best.

The page cache is put in one state before the warm runs, and again after every cold run
(`--page-cache`, see PAGE_CACHE_STATES): by default the checkpoint evicted and read once with
readahead, which leaves it in 2 MiB folios; `--page-cache small` reads it with readahead off,
which leaves it in 4 KiB pages. How much of it is mapped 2 MiB at a time is printed before and
after the runs: a mapping's page faults cost ~10-30x less per page in the large state, so the
zero-copy and column-gather figures depend on it (floor a does not).

Every figure is the median of --repeats runs, interleaved across variants so that a noisy
neighbour hits them alike; the load average is printed with each table. Usage:

    python benchmarks/load.py                      # ~2 GB, T = 1 2 4 8, median of 3
    python benchmarks/load.py --preset reference   # the 777.7 MiB model of BENCHMARKS.md
    python benchmarks/load.py --page-cache small   # the checkpoint cached in 4 KiB pages
    python benchmarks/load.py --layers 8 --tp 2,4 --shards 4 --dir /tmp/ckpt
    python benchmarks/load.py --preset reference --vs-safetensors --repeats 5   # cold floors
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PRESETS = {
    # name: hidden, intermediate, heads, kv heads, vocab, layers
    "default": (2048, 5632, 16, 8, 32003, 18),
    "reference": (1024, 2816, 16, 8, 32003, 29),
    "small": (512, 1408, 8, 8, 32003, 8),
}
TRANSFORMERS_T2 = 1.74  # BENCHMARKS.md: from_pretrained(tp_plan="auto"), 777.7 MiB model, T=2


def llama_config(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
                 layers: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "num_hidden_layers": layers,
        "vocab_size": vocab, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "max_position_embeddings": 4096, "rope_theta": 10000.0,
    }


def llama_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def write_checkpoint(folder: Path, config: dict[str, Any], shards: int) -> None:
    """config.json plus model.safetensors (or `shards` files and an index), random bf16."""
    import ml_dtypes
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    shapes = llama_shapes(config)
    names = list(shapes)
    per = -(-len(names) // shards)
    rng = np.random.default_rng(0)
    weight_map = {}
    for s in range(shards):
        chunk = names[s * per:(s + 1) * per]
        file = "model.safetensors" if shards == 1 else \
            f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        arrays = {}
        for name in chunk:
            n = int(np.prod(shapes[name]))
            bits = rng.integers(0, 1 << 14, n, dtype=np.uint16) + 0x3000  # finite bf16 values
            arrays[name] = bits.view(ml_dtypes.bfloat16).reshape(shapes[name])
            weight_map[name] = file
        save_file(arrays, str(folder / file), metadata={"format": "pt"})
        del arrays
    if shards > 1:
        total = sum(int(np.prod(s)) * 2 for s in shapes.values())
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def reference_checkpoint(folder: Path | None, scratch: str) -> Path:
    """The reference checkpoint (`PRESETS["reference"]`, one file) in `folder`, written there
    unless it already holds it; in `scratch` when `folder` is None."""
    hidden, intermediate, heads, kv, vocab, layers = PRESETS["reference"]
    config = llama_config(hidden, intermediate, heads, kv, vocab, layers)
    folder = folder or Path(scratch) / "checkpoint"
    existing = folder / "config.json"
    if not existing.is_file() or json.loads(existing.read_text()) != config:
        print(f"writing the synthetic checkpoint to {folder} ...", flush=True)
        write_checkpoint(folder, config, 1)
    return folder


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"]
                                               .values()))]
    return [folder / "model.safetensors"]


PAGE_CACHE_STATES = ("large", "small")
"""How the page cache holds the checkpoint in a warm run (`--page-cache`), each made the same
way before the runs: the files evicted, then read once from start to end,

- large: with the kernel's readahead, which on this kernel (6.18, ext4) leaves them in large
  folios, mostly 2 MiB ones that a mapping maps one page-table entry each;
- small: with POSIX_FADV_RANDOM (no readahead), which leaves them in 4 KiB pages, as reads by
  page faults or with readahead off do, and as a file just written (copied, downloaded) is
  held.

A mapping's page faults, a zero-copy view's first touch and a column gather's reads of the
mapping cost ~10-30x less per page in the large state (`huge_mapped` measures which state
the cache is in); a copy from the file (floor a) costs the same in both."""


def warm(files: list[Path], page_cache: str = "large") -> None:
    """Read every file once so its pages are in the page cache (the host evicts idle pages);
    pages read again are read the way `settle` first read them."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as handle:
            if page_cache == "small":
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            while handle.readinto(view):
                pass


def settle(files: list[Path], page_cache: str) -> float:
    """Put the checkpoint in the page cache in state `page_cache` (PAGE_CACHE_STATES): evict
    it, read it once that way; the fraction of it then mapped 2 MiB at a time."""
    evict(files)
    warm(files, page_cache)
    return huge_mapped(files)


MAPPING_LINE = re.compile(r"^([0-9a-f]+)-[0-9a-f]+ ")
"""The first line of a mapping's entry in /proc/self/smaps (its start address)."""


def huge_mapped(files: list[Path]) -> float:
    """The fraction of the checkpoint's bytes a read-only mapping of it maps in 2 MiB entries
    (FilePmdMapped of /proc/self/smaps after touching every page; 0 where it is not told)."""
    import mmap

    total = huge = 0
    for f in files:
        size = f.stat().st_size
        total += size
        if not size:
            continue
        with open(f, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            view = np.frombuffer(mapping, np.uint8)
            int(view[::4096].sum())
            address = view.ctypes.data
            del view
            with open("/proc/self/smaps") as smaps:
                lines = smaps.read().splitlines()
            starts = [(i, int(m.group(1), 16)) for i, line in enumerate(lines)
                      if (m := MAPPING_LINE.match(line))]
            for (i, start), (j, _) in zip(starts, [*starts[1:], (len(lines), 0)], strict=True):
                if start == address:
                    huge += sum(int(row.split()[1]) * 1024 for row in lines[i + 1:j]
                                if row.startswith("FilePmdMapped:"))
                    break
        finally:
            mapping.close()
    return huge / total if total else 0.0


# ------------------------------------------------------------------ child processes

CHILD = r"""
import json, mmap, os, sys, time
mode, spec = sys.argv[1], json.loads(sys.argv[2])

def io():
    with open("/proc/self/io") as f:
        rows = dict(line.split(": ") for line in f.read().splitlines())
    return int(rows["rchar"]), int(rows["read_bytes"])

class Count:
    def __init__(self):
        self.bytes = 0
    def record(self, path, offset, length):
        self.bytes += length

def pages_of(arrays):
    # what `touch` reads: for each mapping the views lie in, the offset of one byte of every
    # 4 KiB page of it their bytes lie on (a strided view, a column slice, row by row: each
    # row's run crosses one page or a few); worked out between the timed load and the timed
    # touch, so that the touch is one read per page, as floor (c)'s, not a numpy call per view
    import numpy as np
    page, plan = 4096, {}
    for a in arrays:
        if not a.size:
            continue
        root = a
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        if isinstance(root, memoryview):  # a view of (part of) a file's mapping: the mapping
            root = root.obj
        key = id(root)
        if key not in plan:
            plan[key] = (np.frombuffer(root, np.uint8), [])
        flat, offsets = plan[key]
        if a.flags.c_contiguous:
            starts, width = np.array([a.ctypes.data], np.int64), a.nbytes
        else:
            k = next(k for k in range(a.ndim) if a[(0,) * k].flags.c_contiguous)
            rows = a.reshape(int(np.prod(a.shape[:k])), -1) if k else a.reshape(1, -1)
            width = rows.shape[1] * rows.itemsize
            starts = rows.ctypes.data + np.arange(rows.shape[0], dtype=np.int64) * rows.strides[0]
        starts = starts - flat.ctypes.data
        first, last = starts // page, (starts + width - 1) // page
        offsets.append(starts)
        if len(starts) == 1:  # one run: the pages after its first
            offsets.append(np.arange(first[0] + 1, last[0] + 1, dtype=np.int64) * page)
            continue
        for step in range(1, int((last - first).max()) + 1):  # rows: a run crosses a few
            offsets.append((first + step)[first + step <= last] * page)
    return [(flat, np.concatenate(offsets)) for flat, offsets in plan.values()]

def touch(pages):
    # one byte read from every page `pages_of` listed
    return sum(int(flat[offsets].sum()) for flat, offsets in pages)

def madvise():
    import ctypes
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function

def floor_d(spec):
    # the share's byte count read in file order into one fresh anonymous mapping, in 8 MiB
    # jobs taken in turn by as many threads as the loader has; each thread faults in its own
    # job's pages first (MADV_POPULATE_WRITE) and then preadv's into them: the loader's own
    # scheme on a share that is one byte run (no column slices)
    import threading
    import numpy as np
    nbytes, step = spec["nbytes"], 8 << 20
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view, address = memoryview(memory), np.frombuffer(memory, np.uint8).ctypes.data
    advise, jobs, at = madvise(), [], 0
    fds = [os.open(f, os.O_RDONLY) for f in spec["files"]]
    for fd in fds:
        size = os.fstat(fd).st_size
        for offset in range(0, size, step):
            length = min(step, size - offset, nbytes - at)
            if length <= 0:
                break
            jobs.append((fd, offset, at, length))
            at += length
    todo, lock = iter(jobs), threading.Lock()
    def work():
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            fd, offset, at, length = job
            advise(address + at, length, 23)
            done = 0
            while done < length:
                got = os.preadv(fd, [view[at + done:at + length]], offset + done)
                if got <= 0:
                    raise SystemExit("short read")
                done += got
    threads = [threading.Thread(target=work) for _ in range(spec["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds:
        os.close(fd)
    return at

result = {}
base = mode.endswith("-base")
if mode.startswith(("loader", "zerocopy", "cold")):
    sys.path.insert(0, spec["build"])
    import importlib
    module = importlib.import_module(spec["module"])
    import ml_dtypes  # a bf16 checkpoint needs it; the runtime imports it on first use
    if spec.get("barrier"):  # a whole node: every rank imported before any starts to load
        print("ready", flush=True)
        sys.stdin.readline()
    if not base:
        hook = Count() if mode == "loader-bytes" else None
        options = {"zero_copy": True} if mode == "zerocopy" else {}
        (r0, b0), t0 = io(), time.monotonic()
        state = module.load(spec["checkpoint"], reader=hook, **options)
        if mode == "zerocopy":
            loaded = time.monotonic()
            pages = pages_of(state.tensors.values())
            touched = time.monotonic()
            touch(pages)
            result["loaded"] = loaded - t0
            t0 += touched - loaded  # the listing of the pages is the benchmark's, not the load's
        t1 = time.monotonic()
        if mode == "zerocopy":  # distinct pages the views lie on (neighbours share edge pages)
            import numpy as np
            result["pages"] = sum(len(np.unique(offsets // 4096)) for _, offsets in pages)
        r1, b1 = io()
        result.update(seconds=t1 - t0, rchar=r1 - r0, read_bytes=b1 - b0,
                      nbytes=sum(a.nbytes for a in state.tensors.values()),
                      hook=hook.bytes if hook else None)
elif mode.startswith("naive"):
    import numpy as np
    from safetensors.numpy import load_file
    import ml_dtypes  # registers bfloat16
    if not base:
        t0 = time.monotonic()
        everything = {}
        for f in spec["files"]:
            everything.update(load_file(f))
        mine = {}
        for name, axis, ranges in spec["selections"]:
            full = everything[name]
            if axis is None:
                mine[name] = full.copy()
            else:
                parts = [full[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
                mine[name] = np.ascontiguousarray(np.concatenate(parts, axis=axis)
                                                  if len(parts) > 1 else parts[0])
        del everything
        result.update(seconds=time.monotonic() - t0)
elif mode.startswith("floor"):
    import numpy as np
    if not base:
        t0 = time.monotonic()
        left = spec["nbytes"]
        if mode == "floor-a":  # read() into one reused 16 MiB buffer
            view = memoryview(bytearray(16 << 20))
            for f in spec["files"]:
                with open(f, "rb", buffering=0) as handle:
                    while left:
                        got = handle.readinto(view[:min(left, len(view))])
                        if not got:
                            break
                        left -= got
        elif mode == "floor-b":  # readinto one fresh array of the whole share
            buf = np.empty(spec["nbytes"], np.uint8)
            view, done = memoryview(buf), 0
            for f in spec["files"]:
                with open(f, "rb", buffering=0) as handle:
                    while done < len(view):
                        got = handle.readinto(view[done:])
                        if not got:
                            break
                        done += got
        elif mode == "floor-d":  # floor (b) the way a copying loader can do it at best
            total = floor_d(spec)
        elif mode == "floor-fault":  # fault in a fresh mapping of the share, one call, one thread
            import ctypes
            memory = mmap.mmap(-1, spec["nbytes"], flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            address = np.frombuffer(memory, np.uint8).ctypes.data
            t0 = time.monotonic()
            if madvise()(address, spec["nbytes"], 23) != 0:  # MADV_POPULATE_WRITE
                raise SystemExit(f"MADV_POPULATE_WRITE failed: errno {ctypes.get_errno()}")
        else:  # floor-c: mmap, one byte read from every page
            total = 0
            for f in spec["files"]:
                with open(f, "rb") as handle:
                    size = min(left, os.fstat(handle.fileno()).st_size)
                    with mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) as m:
                        total += int(np.frombuffer(m, np.uint8)[::4096].sum())
                left -= size
                if not left:
                    break
        result.update(seconds=time.monotonic() - t0)
# ru_maxrss would include the parent: Linux folds the mm left behind at exec into it.
with open("/proc/self/status") as f:
    result["maxrss"] = int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps(result))
"""


IMPORT_CHILD = r"""
import sys, time
t0 = time.monotonic()
if sys.argv[1] == "numpy":
    import numpy
else:
    import partc.runtime
seconds = time.monotonic() - t0
print('{"seconds": %r, "ml_dtypes": %s, "hashlib": %s}' % (
    seconds, str("ml_dtypes" in sys.modules).lower(), str("_hashlib" in sys.modules).lower()))
"""
"""An import timed in a fresh interpreter that has imported nothing else first (the child
above imports json and mmap, which the runtime needs too)."""


def import_child(module: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", IMPORT_CHILD, module], capture_output=True,
                          text=True, env=child_environment())
    if done.returncode:
        raise SystemExit(f"import {module} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with bytecode caching on (a deployment imports from .pyc files)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **WORKERS, **(extra or {})}


WORKERS: dict[str, str] = {}


def start_child(mode: str, spec: dict[str, Any], extra: dict[str, str] | None = None
                ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, mode, json.dumps(spec)],
                            stdin=subprocess.PIPE if spec.get("barrier") else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_environment(extra))


def finish_child(mode: str, proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{mode} child failed:\n{err}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def run_child(mode: str, spec: dict[str, Any], extra: dict[str, str] | None = None
              ) -> dict[str, Any]:
    return finish_child(mode, start_child(mode, spec, extra))


def evict(files: list[Path]) -> None:
    """Drop the checkpoint's pages from the page cache (clean pages only: fsync first)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ------------------------------------------------------------------ main


def compile_builds(folder: Path, builds: Path, tps: list[int]) -> dict[int, dict[str, Any]]:
    import compileall

    from partc.api import CompileOptions, compile_family
    from partc.emit.render import package_name, rank_module_name
    from partc.plan.topology import Topology
    from partc.runtime.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(folder)
    out = {}
    for tp in tps:
        build = builds / f"tp{tp}"
        result = compile_family("llama", folder / "config.json",
                                Topology(tensor_parallel_size=tp, pipeline_parallel_size=1),
                                CompileOptions(checkpoint=folder, out=build))
        # byte-compiled once, as pip compiled partc's own modules: a serving process imports
        # compiled code (where PYTHONDONTWRITEBYTECODE is set, or the build is read-only,
        # nothing else would write it, and compiling the rank module from source measured
        # ~2.4 ms of every T=8 load)
        if not compileall.compile_dir(str(build), quiet=1):
            raise SystemExit(f"could not byte-compile the generated package in {build}")
        plan = result.plan
        rank = plan.ranks[0]
        selections = []
        for t in rank.layout.tensors:
            axis, ranges = t.selection
            selections.append([t.target, axis, [list(r) for r in ranges]])
        world = plan.topology.world_size
        modules = [f"{package_name(plan)}.{rank_module_name(r, world)}" for r in range(world)]
        runs = rank_runs(checkpoint, selections)
        every = [rank_runs(checkpoint, [[t.target, t.selection[0], [list(r) for r in
                                                                  t.selection[1]]]
                                        for t in r.layout.tensors]) for r in plan.ranks]
        out[tp] = {"build": str(build), "module": modules[0], "modules": modules,
                   "checkpoint": str(folder), "local": rank.info.local_parameter_bytes,
                   "selections": selections, "pages": blocks_touched(runs, 4096),
                   "sectors": blocks_touched(runs, 512), "union": union_bytes(every)}
    return out


def rank_runs(checkpoint: Any, selections: list[list[Any]]
              ) -> dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """Absolute (start, length) of every byte run of a rank's selections, per file."""
    from partc.runtime._engine.runs import byte_runs
    from partc.runtime._engine.selection import TensorSelection

    runs: dict[str, list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]] = {}
    for name, axis, ranges in selections:
        header, entry = checkpoint.tensor(name)
        sel = TensorSelection(axis=axis, ranges=tuple(tuple(r) for r in ranges))
        src, _, length = byte_runs(entry, sel)
        if len(src):
            runs.setdefault(str(header.path), []).append(
                (src + header.data_start + entry.begin, length))
    return {path: (np.concatenate([s for s, _ in parts]), np.concatenate([n for _, n in parts]))
            for path, parts in runs.items()}


def blocks_touched(runs: dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]],
                   block: int) -> int:
    """Bytes of the distinct `block`-byte file blocks the runs touch: 4096 is the least a
    page-cache read fetches, 512 (a sector) the least any read from this disk fetches."""
    total = 0
    for start, length in runs.values():
        first, last = start // block, (start + length - 1) // block
        span = last - first + 1
        index = np.repeat(first, span) + (np.arange(int(span.sum()))
                                          - np.repeat(np.cumsum(span) - span, span))
        total += len(np.unique(index)) * block
    return total


def union_bytes(runs: list[dict[str, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]]) -> int:
    """Bytes of the union of several ranks' runs (each byte once)."""
    total = 0
    for path in sorted({p for r in runs for p in r}):
        start = np.concatenate([r[path][0] for r in runs if path in r])
        end = start + np.concatenate([r[path][1] for r in runs if path in r])
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
        reach = np.maximum.accumulate(end)
        before = np.r_[0, reach[:-1]]
        total += int(np.maximum(0, end - np.maximum(start, before)).sum())
    return total


def whole_node(spec: dict[str, Any], tp: int, mode: str = "loader") -> dict[str, float]:
    """The T ranks of a build loading at once: the slowest rank's seconds and the bytes all
    of them fetched from storage."""
    procs = []
    for rank, module in enumerate(spec["modules"]):
        extra = {"LOCAL_WORLD_SIZE": str(tp), "LOCAL_RANK": str(rank)}
        procs.append(start_child(mode, {**spec, "module": module, "barrier": True}, extra))
    for proc in procs:  # as a job's ranks meet at init_process_group before they load
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            finish_child(mode, proc)
            raise SystemExit(f"{mode} child did not start")
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [finish_child(mode, p) for p in procs]
    return {"seconds": max(r["seconds"] for r in results),
            "read_bytes": sum(r["read_bytes"] for r in results)}


def main() -> None:
    try:
        import partc
    except ImportError:
        raise SystemExit("benchmarks/load.py measures the installed partc: run the README's "
                         "set-up (`pip install '.[test]'`, or `pip install -e '.[test]'`) in "
                         "the clone first") from None
    try:
        import safetensors  # noqa: F401  (writes the synthetic checkpoint; the naive baseline)
    except ImportError:
        raise SystemExit("benchmarks/load.py writes its checkpoint with the safetensors library: "
                         "install partc with its test extra (`pip install '.[test]'`, as the "
                         "README's set-up does)") from None
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--shards", type=int, default=1, help="checkpoint files (index if > 1)")
    parser.add_argument("--tp", default="1,2,4,8", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="checkpoint folder (kept; reused if present)")
    parser.add_argument("--naive", action="store_true", help="also run the naive baseline")
    parser.add_argument("--skip-cold", action="store_true", help="skip the cold-cache runs")
    parser.add_argument("--skip-node", action="store_true", help="skip the whole-node runs")
    parser.add_argument("--page-cache", choices=PAGE_CACHE_STATES, default="large",
                        help="how the warm runs find the checkpoint cached: large (read with "
                             "readahead: 2 MiB folios) or small (4 KiB pages); see settle()")
    parser.add_argument("--workers", type=int, default=None,
                        help="loader threads (PARTC_READ_THREADS; default: the cores shared "
                             "among the node's loading ranks, max 8)")
    parser.add_argument("--vs-safetensors", action="store_true",
                        help="only the cold and warm comparison of benchmarks/load_compare.py: "
                             "partc against the cold floors and safetensors get_slice, "
                             "interleaved, bytes fetched beside every time")
    parser.add_argument("--raw", type=Path,
                        help="with --vs-safetensors: also write every run's result to this "
                             "JSON file, in the order run")
    args = parser.parse_args()
    hidden, intermediate, heads, kv, vocab, layers = PRESETS[args.preset]
    config = llama_config(args.hidden or hidden, args.intermediate or intermediate, heads, kv,
                          args.vocab or vocab, args.layers or layers)
    tps = [int(t) for t in args.tp.split(",")]
    if args.workers:
        WORKERS["PARTC_READ_THREADS"] = str(args.workers)
    scratch = tempfile.TemporaryDirectory(prefix="partc-bench-")
    folder = args.dir or Path(scratch.name) / "checkpoint"
    existing = folder / "config.json"
    if not existing.is_file() or json.loads(existing.read_text()) != config:
        print(f"writing the synthetic checkpoint to {folder} ...", flush=True)
        write_checkpoint(folder, config, args.shards)
    files = checkpoint_files(folder)
    total = sum(f.stat().st_size for f in files)
    builds = compile_builds(folder, Path(scratch.name) / "builds", tps)
    from partc.runtime._engine.workers import default_workers

    threads = args.workers or default_workers(1)  # a rank loading alone
    print(f"partc {partc.__version__} from {Path(partc.__file__).parent}")
    print(f"checkpoint: {total / 2**20:.1f} MiB in {len(files)} file(s); hidden "
          f"{config['hidden_size']}, intermediate {config['intermediate_size']}, "
          f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}; rank 0 of each "
          f"T, median of {args.repeats}; {os.cpu_count()} CPUs; loader threads "
          f"{args.workers or 'default'} ({threads} alone)", flush=True)
    if args.vs_safetensors:
        import load_compare

        load_compare.compare(folder, {tp: {**builds[tp], "files": [str(f) for f in files]}
                                      for tp in tps}, args.repeats, args.raw)
        return
    cache = args.page_cache
    huge_before = settle(files, cache)
    print(f"page cache: {cache} (the checkpoint evicted, then read once "
          f"{'with readahead' if cache == 'large' else 'with POSIX_FADV_RANDOM'}; again after "
          f"every cold run): {huge_before:.0%} of it mapped in 2 MiB entries", flush=True)
    load_before = os.getloadavg()

    base = {m: run_child(m, builds[tps[0]])["maxrss"]
            for m in ("loader-base", "naive-base", "floor-base")}
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    variants = ["loader", "zerocopy", "floor-a", "floor-b", "floor-c", "floor-d", "floor-fault"] + (
        ["naive"] if args.naive else [])
    for repeat in range(args.repeats):
        for position, tp in enumerate(tps):
            spec = {**builds[tp], "files": [str(f) for f in files],
                    "nbytes": builds[tp]["local"], "threads": threads}
            # rotate the order: a variant that frees much memory makes the next process's
            # first touches slower while the host takes the freed pages back
            turn = (repeat + position) % len(variants)
            for mode in variants[turn:] + variants[:turn]:
                warm(files, cache)
                runs.setdefault((tp, mode), []).append(run_child(mode, spec))
            if not args.skip_node and tp > 1:
                warm(files, cache)
                runs.setdefault((tp, "node"), []).append(whole_node(spec, tp))
            if not args.skip_cold:
                evict(files)
                runs.setdefault((tp, "cold"), []).append(run_child("cold", spec))
                if not args.skip_node and tp > 1:
                    evict(files)
                    runs.setdefault((tp, "node-cold"), []).append(whole_node(spec, tp, "cold"))
                settle(files, cache)  # a cold load left the pages it read its own way
    hooks = {}
    for tp in tps:
        warm(files, cache)
        hooks[tp] = run_child("loader-bytes", builds[tp])
    huge_after = huge_mapped(files)
    imports: dict[str, list[dict[str, Any]]] = {"numpy": [], "partc.runtime": []}
    for _ in range(max(15, 5 * args.repeats)):
        for module in imports:
            imports[module].append(import_child(module))
    load_after = os.getloadavg()

    def med(tp: int, mode: str, key: str = "seconds") -> float:
        return statistics.median(r[key] for r in runs[(tp, mode)])

    rows = []
    for tp in tps:
        local = builds[tp]["local"]
        loader = med(tp, "loader")
        a, b, c = med(tp, "floor-a"), med(tp, "floor-b"), med(tp, "floor-c")
        d = med(tp, "floor-d")
        row: dict[str, Any] = {
            "T": tp, "share MiB": local / 2**20, "loader s": loader,
            "floor a s": a, "floor b s": b, "floor c s": c, "floor d s": d,
            "loader/a": loader / a, "loader/b": loader / b, "d/a": d / a, "loader/d": loader / d,
            "fault us/page": med(tp, "floor-fault") / (local / 4096) * 1e6,
            "zero-copy+touch/c": med(tp, "zerocopy") / c,
            # the pages the views lie on over the share's: a column slice's view crosses a page
            # of every row, so the touch reads more pages than floor (c) does at T >= 2
            "zero-copy pages/share pages": med(tp, "zerocopy", "pages") / -(-local // 4096),
            "zero-copy load s": med(tp, "zerocopy", "loaded"),
        }
        if args.naive:
            row["naive/loader"] = med(tp, "naive") / loader
        row["warm hook/share"] = hooks[tp]["hook"] / local
        if not args.skip_cold:
            row["cold s"] = med(tp, "cold")
            row["cold fetched/share"] = med(tp, "cold", "read_bytes") / local
            row["pages/share"] = builds[tp]["pages"] / local
            row["sectors/share"] = builds[tp]["sectors"] / local
            if not args.skip_node and tp > 1:
                row["node cold fetched/union"] = (med(tp, "node-cold", "read_bytes")
                                                  / builds[tp]["union"])
                row["node cold slowest s"] = med(tp, "node-cold")
        row["RSS-base MiB"] = (med(tp, "loader", "maxrss") - base["loader-base"]) / 2**20
        row["share+64"] = local / 2**20 + 64
        row["zero-copy RSS-base MiB"] = (med(tp, "zerocopy", "maxrss")
                                         - base["loader-base"]) / 2**20
        if not args.skip_node:
            row["node slowest/alone"] = med(tp, "node") / loader if tp > 1 else None
            if 1 in tps:  # the T ranks together load the whole model once, as T=1 does
                row["node slowest/T=1"] = med(tp, "node") / med(1, "loader") if tp > 1 \
                    else None
        rows.append(row)
    print(f"load average (1, 5, 15 min): before {fmt_load(load_before)}, after "
          f"{fmt_load(load_after)}")
    print(f"page cache {cache}: {huge_before:.0%} of the checkpoint mapped in 2 MiB entries "
          f"before the runs, {huge_after:.0%} after")
    print_table(rows)
    print(f"\ntransformers from_pretrained(tp_plan='auto'), T=2, BENCHMARKS.md reference model: "
          f"{TRANSFORMERS_T2} s process start to return (not measured here).")
    numpy_s = [r["seconds"] * 1e3 for r in imports["numpy"]]
    runtime_s = [r["seconds"] * 1e3 for r in imports["partc.runtime"]]
    paired = statistics.median(b - a for a, b in zip(numpy_s, runtime_s, strict=True))
    print(f"import partc.runtime {statistics.median(runtime_s):.0f} ms, import numpy "
          f"{statistics.median(numpy_s):.0f} ms (fresh interpreters, alternating, median of "
          f"{len(numpy_s)}): runtime - numpy = {paired:.0f} ms median of the pairs, "
          f"{min(runtime_s) - min(numpy_s):.0f} ms best against best (target <= 30); "
          f"ml_dtypes imported: {any(r['ml_dtypes'] for r in imports['partc.runtime'])}, "
          f"OpenSSL (_hashlib) imported: {any(r['hashlib'] for r in imports['partc.runtime'])}")
    print(f"interpreter+imports baseline RSS: loader {base['loader-base'] / 2**20:.0f} MiB, "
          f"floor {base['floor-base'] / 2**20:.0f} MiB")
    verdicts(rows)
    scratch.cleanup()


def fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("| " + " | ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)) + " |")


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def verdicts(rows: list[dict[str, Any]]) -> None:
    print("\ntargets:")
    for r in rows:
        checks = [
            ("warm bytes <= 1.02x", r["warm hook/share"] <= 1.02),
            ("loader <= 1.5x floor a", r["loader/a"] <= 1.5),
            ("zero-copy <= 2x floor c", r["zero-copy+touch/c"] <= 2),
            ("RSS <= share+64MiB", r["RSS-base MiB"] <= r["share+64"]),
        ]
        if "cold fetched/share" in r:
            checks.append(("cold fetched <= 1.05x share", r["cold fetched/share"] <= 1.05))
        print(f"  T={r['T']}: " + ", ".join(f"{n} {'ok' if ok else 'MISSED'}"
                                           for n, ok in checks))


if __name__ == "__main__":
    main()
