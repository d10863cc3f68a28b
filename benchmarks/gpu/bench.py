"""Measure partc's `load(device="cuda")` on a GPU machine against the copy floors and the loaders
a user would otherwise pick, every figure in a fresh process.

Writes synthetic bf16 Llama checkpoints in Hugging Face naming (the 777.6 MiB model of
../shared/BENCHMARKS.md and a ~7.8 GiB one, both from benchmarks/load.py's generator, seeded),
compiles the built-in `llama` family for each T, and measures rank 0's share:

- floors: one process copies 256 MiB blocks host->device (into distinct device offsets, the
  device buffer the size of the largest share) from a pinned buffer (`cudaMemcpy` from
  page-locked memory: what no loader can beat) and from a pageable one (already faulted in); a
  share's floor is its bytes at that rate;
- partc: the generated module's `load(ckpt, rank=0, device="cuda:0")` then
  `torch.cuda.synchronize()`, in a process that has initialised CUDA and imported the package
  first (the figure is the load, not the CUDA context); "first" is the process's first load,
  "again" the best of two more in the same process; warm (the files read into the page cache
  beforehand) and cold (evicted with POSIX_FADV_DONTNEED first; bytes fetched from storage are
  /proc/self/io read_bytes); host memory sampled every 2 ms during the first load (RssAnon:
  the process's own memory, pinned staging included; RssFile: page-cache pages mapped while
  read) over what it held before; device memory peak over the share
  (`torch.cuda.max_memory_allocated`);
- safetensors get_slice: `safe_open(file, framework="pt", device="cuda:0")` and
  `get_slice(name)[...]` of exactly the rank's ranges (torch.cat where a selection has several);
- safetensors whole: `safetensors.torch.load_file(file, device="cuda:0")` of every file, then
  the rank's slices made contiguous and the rest dropped;
- node: all T ranks of a build loading at once on the one GPU (`LOCAL_WORLD_SIZE=T`, so each
  takes its share of the cores), released together once all have imported; the slowest rank
  over rank 0 alone;
- digest: partc's load with `verify="digest"` (sha256 of every tensor taken on the staging
  ring) against the same load without it.

Usage (benchmarks/gpu/run.sh runs it): `python3 benchmarks/gpu/bench.py --out DIR [--quick]`.
Results: DIR/results.json (every figure with its command) and DIR/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for load.py's checkpoint generator
import load as cpu_bench  # noqa: E402

MODELS = {
    # name: preset (hidden, intermediate, heads, kv heads, vocab, layers), shards, T values
    "768": ((1024, 2816, 16, 8, 32003, 29), 1, [1, 2, 4, 8]),
    "8G": ((2048, 5632, 16, 8, 32003, 86), 4, [1, 8]),
}
BLOCK = 256 << 20

CHILD = r"""
import json, os, sys, threading, time
spec = json.loads(sys.argv[1])
import torch
torch.cuda.init()
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
torch.empty(1, device=dev)
torch.cuda.synchronize()
out = {}

def status():
    rows = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                rows[key] = int(value.split()[0]) * 1024
    return rows

def io_bytes():
    with open("/proc/self/io") as f:
        return int(dict(l.split(": ") for l in f.read().splitlines())["read_bytes"])

class Sampler:
    def __init__(self):
        self.base = status(); self.peak = dict(self.base); self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True); self.thread.start()
    def run(self):
        while not self.stop:
            for k, v in status().items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            time.sleep(0.002)
    def done(self):
        self.stop = True; self.thread.join()
        for k, v in status().items():
            self.peak[k] = max(self.peak.get(k, 0), v)
        keys = ("RssAnon", "RssFile", "VmRSS")
        return {f"peak_{k}_over": self.peak[k] - self.base[k] for k in keys}

def timed(fn):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev); sampler = Sampler(); r0 = io_bytes()
    t0 = time.perf_counter(); result = fn(); torch.cuda.synchronize(); t1 = time.perf_counter()
    row = {"seconds": t1 - t0, "read_bytes": io_bytes() - r0,
           "device_peak_over": torch.cuda.max_memory_allocated(dev) - before}
    row.update(sampler.done())
    return result, row

mode = spec["mode"]
if mode == "floors":
    host = {"pinned": torch.empty(spec["block"], dtype=torch.uint8, pin_memory=True),
            "pageable": torch.empty(spec["block"], dtype=torch.uint8)}
    for h in host.values():
        h.fill_(1)
    target = torch.empty(spec["largest"], dtype=torch.uint8, device=dev)
    blocks = max(1, spec["largest"] // spec["block"])
    for kind, h in host.items():
        best = None
        for _ in range(3):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for b in range(blocks):
                target[b * spec["block"]:(b + 1) * spec["block"]].copy_(h, non_blocking=True)
            torch.cuda.synchronize(); t = time.perf_counter() - t0
            best = t if best is None else min(best, t)
        out[kind + "_GBps"] = blocks * spec["block"] / best / 1e9
    small = host["pinned"][: 16 << 20]
    count = min(64, spec["largest"] // (16 << 20))
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for b in range(count):
        target[b * (16 << 20):(b + 1) * (16 << 20)].copy_(small, non_blocking=True)
    torch.cuda.synchronize()
    out["pinned_16MiB_blocks_GBps"] = count * (16 << 20) / (time.perf_counter() - t0) / 1e9
    out["device"] = torch.cuda.get_device_name(dev)
    out["torch"] = torch.__version__
elif mode in ("partc", "partc-digest"):
    sys.path.insert(0, spec["build"])
    import importlib
    loaders = importlib.import_module(spec["package"])
    options = {"verify": "digest"} if mode == "partc-digest" else {}
    if spec.get("workers"):
        options["workers"] = spec["workers"]
    def go():
        return loaders.load(spec["checkpoint"], rank=spec["rank"], device=dev, **options)
    state, row = timed(go)
    out["first"] = row
    out["share"] = sum(t.local_bytes for t in state.layout.tensors)
    out["tensors"] = len(state.tensors)
    del state
    again = []
    for _ in range(spec.get("again", 2)):
        state, row = timed(go)
        again.append(row["seconds"]); del state
    out["again"] = min(again) if again else None
elif mode == "node":
    sys.path.insert(0, spec["build"])
    import importlib
    loaders = importlib.import_module(spec["package"])
    open(spec["ready"], "w").close()
    while not os.path.exists(spec["go"]):
        time.sleep(0.0005)
    state, row = timed(lambda: loaders.load(spec["checkpoint"], rank=spec["rank"], device=dev))
    out["first"] = row
elif mode in ("st-slice", "st-whole"):
    from safetensors import safe_open
    from safetensors.torch import load_file
    selections = spec["selections"]  # name -> [file, axis, ranges]
    def cut(t, axis, ranges):
        if axis is None:
            return t
        parts = [t.narrow(axis, a, b - a) for a, b in ranges]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=axis)
    def by_slice():
        result = {}
        files = sorted({v[0] for v in selections.values()})
        for f in files:
            with safe_open(f, framework="pt", device="cuda:0") as handle:
                for name, (file, axis, ranges) in selections.items():
                    if file != f:
                        continue
                    sl = handle.get_slice(name)
                    if axis is None:
                        result[name] = sl[:]
                    else:
                        parts = [sl[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
                        result[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)
        return result
    def whole():
        result = {}
        for f in sorted({v[0] for v in selections.values()}):
            everything = load_file(f, device="cuda:0")
            for name, (file, axis, ranges) in selections.items():
                if file == f:
                    result[name] = cut(everything[name], axis, ranges)
            del everything
        return result
    fn = by_slice if mode == "st-slice" else whole
    result, row = timed(fn)
    out["first"] = row
    del result
    again = []
    for _ in range(spec.get("again", 2)):
        result, r = timed(fn); again.append(r["seconds"]); del result
    out["again"] = min(again) if again else None
print("RESULT " + json.dumps(out))
"""


def run_child(spec: dict[str, Any], env: dict[str, str] | None = None,
              timeout: float = 300) -> dict[str, Any]:
    """One measurement in a fresh python3; its RESULT line parsed."""
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{spec['mode']} failed (exit {done.returncode}): {done.stderr[-3000:]}")


def start_node(spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    """One rank of a whole-node run, started (it waits for the go file)."""
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})


def compile_build(checkpoint: Path, out: Path, tp: int, digests: bool = False) -> str:
    """`partc compile` of the built-in llama family; the generated package's name."""
    command = [sys.executable, "-m", "partc", "compile", "--config", str(checkpoint /
               "config.json"), "--tp", str(tp), "--out", str(out), "--checkpoint",
               str(checkpoint), "--format", "json"]
    if digests:
        command.append("--digests")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"compile failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return next(p.name for p in sorted(out.iterdir()) if p.is_dir() and p.name.startswith("partc_"))


def selections(build: Path, package: str, checkpoint: Path, rank: int) -> dict[str, Any]:
    """The rank's tensors as (file, axis, ranges), read from a host zero-copy load."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import importlib; "
            "m = importlib.import_module(sys.argv[2]); "
            "s = m.load(sys.argv[3], rank=int(sys.argv[4]), zero_copy=True); "
            "print(json.dumps({t.target: [t.selection[0], t.selection[1]] "
            "for t in s.layout.tensors}))")
    done = subprocess.run([sys.executable, "-c", code, str(build), package, str(checkpoint),
                           str(rank)], capture_output=True, text=True, timeout=300, check=True)
    layout = json.loads(done.stdout.splitlines()[-1])
    files = {name: str(checkpoint / "model.safetensors") for name in layout}
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        files = {name: str(checkpoint / file) for name, file in
                 json.loads(index.read_text())["weight_map"].items()}
    return {name: [files[name], axis, ranges] for name, (axis, ranges) in layout.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go")
    parser.add_argument("--quick", action="store_true", help="the 768 model only")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds after which no further measurement starts")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.dir or Path(tempfile.mkdtemp(prefix="partc-gpu-"))
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(), "cores": os.cpu_count(), "python": platform.python_version(),
        "command": "benchmarks/gpu/run.sh", "models": {}, "errors": []}

    def save() -> None:
        text = json.dumps(results, indent=1, sort_keys=True)
        (args.out / "results.json").write_text(text + "\n")

    def attempt(label: str, fn: Any, *call: Any) -> Any:
        if time.monotonic() - started > args.budget:
            results["errors"].append(f"{label}: skipped, past the {args.budget:.0f} s budget")
            return None
        try:
            return fn(*call)
        except Exception as error:  # a failed measurement is recorded, the rest still run
            results["errors"].append(f"{label}: {error}"[:3000])
            print(f"!! {label}: {error}"[:3000], flush=True)
            return None
        finally:
            save()

    models = {"768": MODELS["768"]} if args.quick else MODELS
    largest = 0
    prepared: dict[str, Any] = {}
    for name, (preset, shards, tps) in models.items():
        folder = root / name
        t0 = time.perf_counter()
        config = cpu_bench.llama_config(*preset)
        cpu_bench.write_checkpoint(folder, config, shards)
        files = cpu_bench.checkpoint_files(folder)
        size = sum(f.stat().st_size for f in files)
        largest = max(largest, size)
        builds = {}
        for tp in tps:
            out = root / f"build-{name}-tp{tp}"
            builds[tp] = (out, compile_build(folder, out, tp))
        prepared[name] = (folder, files, builds, tps)
        results["models"][name] = {"bytes": size, "files": len(files), "preset": preset,
                                   "prepare_seconds": time.perf_counter() - t0, "T": {}}
        print(f"{name}: {size / 2**20:.1f} MiB written and compiled in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        save()
    floors = attempt("floors", run_child,
                     {"mode": "floors", "block": BLOCK, "largest": largest + BLOCK})
    results["floors"] = floors
    for name, (folder, files, builds, tps) in prepared.items():
        model = results["models"][name]
        for tp in tps:
            build, package = builds[tp]
            row: dict[str, Any] = {}
            model["T"][str(tp)] = row
            base = {"build": str(build), "package": package, "checkpoint": str(folder),
                    "rank": 0}
            alone = {"LOCAL_WORLD_SIZE": "1"}
            label = f"{name} T={tp}"
            cpu_bench.warm(files)
            row["partc"] = attempt(f"{label} partc", run_child, {**base, "mode": "partc"}, alone)
            if tp == 1:  # the same load with one reader thread: what the threads bring
                row["partc_1_thread"] = attempt(f"{label} partc 1 thread", run_child,
                                                {**base, "mode": "partc", "workers": 1}, alone)
            chosen = attempt(f"{label} selections", selections, build, package, folder, 0)
            if chosen is not None:
                row["st_slice"] = attempt(f"{label} st-slice", run_child,
                                          {"mode": "st-slice", "selections": chosen}, alone)
                row["st_whole"] = attempt(f"{label} st-whole", run_child,
                                          {"mode": "st-whole", "selections": chosen,
                                           "again": 1}, alone)
            cpu_bench.evict(files)
            row["partc_cold"] = attempt(f"{label} partc cold", run_child,
                                        {**base, "mode": "partc", "again": 0}, alone)
            cpu_bench.warm(files)
            if tp > 1:
                row["node"] = attempt(f"{label} node", node, base, tp)
            if floors and row.get("partc"):
                share = row["partc"]["share"]
                row["share"] = share
                row["pinned_floor_s"] = share / (floors["pinned_GBps"] * 1e9)
                row["pageable_floor_s"] = share / (floors["pageable_GBps"] * 1e9)
            save()
        if name == "768":
            out = root / "build-768-digests"
            package = attempt("768 digest compile", compile_build, folder, out, 1, True)
            if package:
                cpu_bench.warm(files)
                base = {"build": str(out), "package": package, "checkpoint": str(folder),
                        "rank": 0}
                model["digest"] = {
                    "plain": attempt("768 plain", run_child, {**base, "mode": "partc"}),
                    "digest": attempt("768 digest", run_child,
                                      {**base, "mode": "partc-digest"})}
    results["seconds"] = time.monotonic() - started
    save()
    (args.out / "table.md").write_text(table(results))
    print(table(results), flush=True)


def node(base: dict[str, Any], tp: int) -> dict[str, Any]:
    """All `tp` ranks at once on the one GPU; each rank's figures."""
    with tempfile.TemporaryDirectory() as marks:
        go = os.path.join(marks, "go")
        procs = []
        for rank in range(tp):
            spec = {**base, "mode": "node", "rank": rank,
                    "ready": os.path.join(marks, f"ready-{rank}"), "go": go}
            procs.append(start_node(spec, {"LOCAL_WORLD_SIZE": str(tp),
                                           "LOCAL_RANK": str(rank)}))
        deadline = time.monotonic() + 240
        while not all(os.path.exists(os.path.join(marks, f"ready-{r}")) for r in range(tp)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a node rank did not start: " + "".join(
                    (p.communicate()[1] or "")[-1500:] for p in procs))
            time.sleep(0.01)
        open(go, "w").close()
        rows = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"a node rank failed: {stderr[-2000:]}")
            rows.append(json.loads(line[7:])["first"])
    return {"ranks": rows, "slowest_s": max(r["seconds"] for r in rows)}


def table(results: dict[str, Any]) -> str:
    """The results as a markdown table."""
    floors = results.get("floors") or {}
    lines = [f"H2D floors: pinned {floors.get('pinned_GBps', 0):.1f} GB/s (16 MiB blocks "
             f"{floors.get('pinned_16MiB_blocks_GBps', 0):.1f}), pageable "
             f"{floors.get('pageable_GBps', 0):.1f} GB/s, {floors.get('device', '?')}, "
             f"torch {floors.get('torch', '?')}", "",
             "| model | T | share MiB | pinned floor s | partc first s | partc again s | "
             "partc GB/s | partc / pinned floor | st get_slice s | st whole s | partc cold s |"
             " cold fetched / share | node slowest / alone | RssAnon peak MiB | RssFile peak"
             " MiB | device peak / share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def get(row: Any, *keys: str) -> Any:
        for key in keys:
            if not isinstance(row, dict) or row.get(key) is None:
                return None
            row = row[key]
        return row

    def fmt(value: Any, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    for name, model in results["models"].items():
        for tp, row in model["T"].items():
            share = get(row, "partc", "share")
            first = get(row, "partc", "first", "seconds")
            floor = row.get("pinned_floor_s")
            cold = get(row, "partc_cold", "first")
            node_s = get(row, "node", "slowest_s")
            lines.append("| " + " | ".join([
                name, tp, fmt(share and share / 2**20, ".1f"), fmt(floor),
                fmt(first), fmt(get(row, "partc", "again")),
                fmt(share and first and share / first / 1e9, ".1f"),
                fmt(floor and first and floor / first, ".2f"),
                fmt(get(row, "st_slice", "first", "seconds")),
                fmt(get(row, "st_whole", "first", "seconds")),
                fmt(get(cold, "seconds")),
                fmt(share and get(cold, "read_bytes") and get(cold, "read_bytes") / share, ".3f"),
                fmt(node_s and first and node_s / first, ".2f"),
                fmt(get(row, "partc", "first", "peak_RssAnon_over") and
                    get(row, "partc", "first", "peak_RssAnon_over") / 2**20, ".1f"),
                fmt(get(row, "partc", "first", "peak_RssFile_over") and
                    get(row, "partc", "first", "peak_RssFile_over") / 2**20, ".1f"),
                fmt(share and get(row, "partc", "first", "device_peak_over") and
                    get(row, "partc", "first", "device_peak_over") / share, ".3f")]) + " |")
    one = get(results, "models", "768", "T", "1", "partc_1_thread", "first", "seconds")
    if one:
        lines += ["", f"768 T=1 with one reader thread: {fmt(one)} s"]
    one = get(results, "models", "8G", "T", "1", "partc_1_thread", "first", "seconds")
    if one:
        lines += ["", f"8G T=1 with one reader thread: {fmt(one)} s"]
    digest = get(results, "models", "768", "digest")
    if digest:
        lines += ["", f"768 T=1 digest: plain {fmt(get(digest, 'plain', 'first', 'seconds'))} s,"
                  f" verify=digest {fmt(get(digest, 'digest', 'first', 'seconds'))} s"]
    if results.get("errors"):
        lines += ["", "errors:"] + [f"- {e}" for e in results["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
