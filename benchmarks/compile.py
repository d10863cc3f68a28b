"""Measure compile time, generated-module import time and header validation at full size.

For each full-size inventory in tests/fixtures/fullsize (Llama-3.1-70B with the `llama`
family; DeepSeek-V3 with `deepseek_v3`, FP8 companions included, when that family is built in)
this script writes a header-only safetensors file (8-byte length + the real header JSON + a
sparse data region of the right size), then, each in a fresh process:

- compile: bind + plan (checkpoint header checked and fingerprinted) + code generation for all
  T x S ranks, and the atomic write of the build;
- import: `partc.runtime`, then the largest rank module, cold (compiled from source, which
  writes the .pyc) and warm (from the .pyc, as every later start of a deployment);
- header: `open_checkpoint` (read + validate the whole header) and the rank's check against the
  plan (names, dtypes, shapes and the header fingerprint, which a byte-identical header vouches
  for through its digest), plus the fingerprint's own cost, paid when the header bytes differ
  from the compiled checkpoint's (e.g. the same tensors resharded).

Targets (DeepSeek-V3, 64 ranks): compile <= 10 s, one rank module imports in <= 100 ms, a full
header validates in <= 1 s. DeepSeek-V3 is also measured expert-parallel (docs/expert_parallel.md)
at EP=64 x PP=2 (T=1: 128 ranks, target compile <= 10 s) and EP=8 x T=8 (8 ranks). Usage:

    python benchmarks/compile.py                       # both models, T=8, S=8, and the EP runs
    python benchmarks/compile.py --ep ""                # without the expert-parallel runs
    python benchmarks/compile.py --models Llama-3.1-70B --repeats 3
    python benchmarks/compile.py --profile DeepSeek-V3  # cProfile of the compile, top 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FULLSIZE = ROOT / "tests" / "fixtures" / "fullsize"
MODELS = {"Llama-3.1-70B": "llama", "DeepSeek-V3": "deepseek_v3"}


def header_only_checkpoint(model: str, folder: Path) -> Path:
    """config.json plus a model.safetensors holding the real header and a sparse data region."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(FULLSIZE / model / "config.json", folder / "config.json")
    text = (FULLSIZE / model / "safetensors_header.json").read_bytes().rstrip(b"\n")
    header = json.loads(text)
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        handle.truncate(8 + len(text) + end)  # sparse: no payload is ever read
    return folder


CHILD = r'''
import json, sys, time
t_start = time.perf_counter()
mode, spec = sys.argv[1], json.loads(sys.argv[2])
result = {}
if mode == "compile":
    from pathlib import Path
    from partc.api import plan_family
    from partc.emit.render import render_package
    from partc.output import write_atomically
    from partc.plan.topology import Topology
    t0 = time.perf_counter()
    topology = Topology(tensor_parallel_size=spec["tp"], pipeline_parallel_size=spec["pp"],
                        expert_parallel_size=spec.get("ep"))
    plan = plan_family(spec["family"], spec["config"], topology, checkpoint=spec["checkpoint"])
    t1 = time.perf_counter()
    files = render_package(plan)
    t2 = time.perf_counter()
    write_atomically(Path(spec["out"]), files, kind="build")
    t3 = time.perf_counter()
    counts = [r.info.owned_tensors for r in plan.ranks]
    result.update(plan=t1 - t0, codegen=t2 - t1, write=t3 - t2, total=t3 - t0,
                  tensors=len(plan.tensors), rows=sum(counts), ranks=len(plan.ranks),
                  largest=max(range(len(counts)), key=counts.__getitem__),
                  megabytes=sum(len(v) for v in files.values()) / 1e6)
elif mode == "import":
    import importlib
    sys.path.insert(0, spec["build"])
    t0 = time.perf_counter()
    import partc.runtime
    t1 = time.perf_counter()
    module = importlib.import_module(spec["module"])
    t2 = time.perf_counter()
    result.update(runtime=t1 - t0, module=t2 - t1)
elif mode == "header":
    import importlib
    sys.path.insert(0, spec["build"])
    from partc.runtime.checkpoint import open_checkpoint
    from partc.runtime.loader import check_header
    module = importlib.import_module(spec["module"])
    t0 = time.perf_counter()
    checkpoint = open_checkpoint(spec["checkpoint"])
    t1 = time.perf_counter()
    errors = check_header(module._TABLE, checkpoint)
    t2 = time.perf_counter()
    assert not errors, errors[:3]
    checkpoint.fingerprint()  # what the check adds when the header bytes differ (a reshard)
    t3 = time.perf_counter()
    result.update(read=t1 - t0, check=t2 - t1, total=t2 - t0, fingerprint=t3 - t2,
                  tensors=len(checkpoint.names))
elif mode == "profile":
    import cProfile, pstats
    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology
    cProfile.run("compile_family(spec['family'], spec['config'], Topology(tensor_parallel_size="
                 "spec['tp'], pipeline_parallel_size=spec['pp']), "
                 "CompileOptions(checkpoint=spec['checkpoint']))", spec["out"])
    pstats.Stats(spec["out"]).sort_stats("cumulative").print_stats(30)
    pstats.Stats(spec["out"]).sort_stats("tottime").print_stats(20)
print(json.dumps(result))
'''


def child(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    # bytecode caching on: the cold import compiles and caches the module, the warm one reuses
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(spec)],
                          capture_output=True, text=True, check=False, env=env)
    if proc.returncode:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    if mode == "profile":
        print(proc.stdout)
        return {}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def builtin_families() -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "partc.cli", "families"], capture_output=True,
                          text=True, check=False)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of the import and header measurements (median)")
    parser.add_argument("--compile-repeats", type=int, default=3,
                        help="runs of the compile (median; DeepSeek-V3 is slow)")
    parser.add_argument("--profile", default=None, help="print a cProfile of one model's compile")
    parser.add_argument("--ep", default="1x2x64,8x1x8",
                        help="DeepSeek-V3 expert-parallel runs, TxSxE comma-separated (default "
                             "EP=64 x PP=2 and EP=8 x T=8; '' for none)")
    args = parser.parse_args()
    cases: list[tuple[str, int, int, int | None]] = [
        (model, args.tp, args.pp, None) for model in args.models.split(",")]
    for text in filter(None, args.ep.split(",")):
        tp, pp, ep = (int(x) for x in text.split("x"))
        cases.append(("DeepSeek-V3", tp, pp, ep))
    families = builtin_families()
    scratch = Path(tempfile.mkdtemp(prefix="partc-compile-bench-"))
    rows, notes = [], []
    try:
        for model, tp, pp, ep in cases:
            family = MODELS[model]
            label = model if ep is None else f"{model} T{tp} S{pp} EP{ep}"
            if family not in families:
                notes.append(f"{model}: skipped, `partc families` does not list {family} yet")
                continue
            folder = scratch / model / "checkpoint"
            if not folder.exists():
                header_only_checkpoint(model, folder)
            spec = {"family": family, "config": str(folder / "config.json"),
                    "checkpoint": str(folder), "tp": tp, "pp": pp, "ep": ep,
                    "out": str(scratch / model / f"build-{tp}-{pp}-{ep}")}
            if args.profile == model and ep is None:
                child("profile", {**spec, "out": str(scratch / f"{model}.prof")})
            try:
                compiles = [child("compile", spec) for _ in range(args.compile_repeats)]
            except RuntimeError as error:
                notes.append(f"{label}: compile failed: {str(error).splitlines()[-1]}")
                continue
            first = compiles[0]
            package = next(p.name for p in Path(spec["out"]).iterdir() if p.is_dir())
            world = first["ranks"]
            module = f"{package}.rank_{first['largest']:0{max(2, len(str(world - 1)))}d}"
            load = {"build": spec["out"], "module": module, "checkpoint": str(folder)}
            cold, warm = [], []
            for _ in range(args.repeats):
                for cache in Path(spec["out"]).rglob("__pycache__"):
                    shutil.rmtree(cache)
                cold.append(child("import", load))
                warm.append(child("import", load))
            headers = [child("header", load) for _ in range(args.repeats)]
            rows.append({
                "model": label, "ranks": world, "tensors": first["tensors"],
                "rank rows": first["rows"], "output MB": first["megabytes"],
                "plan s": median(compiles, "plan"), "codegen s": median(compiles, "codegen"),
                "write s": median(compiles, "write"), "compile s": median(compiles, "total"),
                "import runtime ms": 1000 * median(warm, "runtime"),
                "rank module cold ms": 1000 * median(cold, "module"),
                "rank module warm ms": 1000 * median(warm, "module"),
                "header read s": median(headers, "read"),
                "check vs plan s": median(headers, "check"),
                "header total s": median(headers, "total"),
                "+ fingerprint if resharded s": median(headers, "fingerprint"),
            })
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"T={args.tp} x S={args.pp} (EP runs: as their column says); {os.cpu_count()} CPUs; "
          f"import/header: median of {args.repeats} fresh processes; compile: median of "
          f"{args.compile_repeats}")
    if rows:  # one column per model
        keys = list(rows[0])
        cells = [[fmt(r[k]) for k in keys] for r in rows]
        widths = [max(len(c[i]) for i in range(len(keys))) for c in cells]
        label = max(map(len, keys))
        for i, key in enumerate(keys):
            print(f"| {key:<{label}} | " + " | ".join(
                c[i].rjust(w) for c, w in zip(cells, widths, strict=True)) + " |")
            if i == 0:
                print(f"|{'-' * (label + 2)}|" + "|".join("-" * (w + 1) + ":" for w in widths)
                      + "|")
    for note in notes:
        print(note)
    print("\ntargets (DeepSeek-V3, 64 ranks; expert-parallel: up to 128 ranks): compile <= 10 s, "
          "rank module import <= 100 ms, header <= 1 s")
    for r in rows:
        print(f"  {r['model']}: compile {verdict(r['compile s'], 10)}, import (warm, runtime "
              f"already imported) {verdict(r['rank module warm ms'], 100)}, cold "
              f"{verdict(r['rank module cold ms'], 100)}, header "
              f"{verdict(r['header total s'], 1)}")


def verdict(value: float, limit: float) -> str:
    return "ok" if value <= limit else f"MISSED ({value / limit:.2f}x the target)"


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


if __name__ == "__main__":
    main()
