"""Measure partc's generated loaders against the naive baseline and the sequential-read floor.

Writes a synthetic bf16 Llama checkpoint in Hugging Face naming (~2 GB by default) and its
config.json, compiles the built-in `llama` family for TP = 1, 2, 4, 8 (PP = 1), and measures
rank 0 of each build in fresh processes, warming the page cache before every run:

- loader: `partc` generated module `load(checkpoint)` (time around the call);
- naive:  `safetensors.numpy.load_file` of every file, then slicing out the rank's share;
- floor:  reading the rank's byte count sequentially from the checkpoint (min of `read()` into
  a fresh bytes object and `readinto` a fresh numpy buffer);
- start:  process start to the last tensor in memory, for the loader (interpreter + imports +
  header check + reads), to compare with transformers' row in BENCHMARKS.md;
- bytes read: the loader's `reader=` hook (bytes copied out of the file) and /proc/self/io rchar
  around the call (the header included);
- peak RSS: the process's VmHWM (ru_maxrss would include this parent process: Linux folds the
  mm left behind at exec into it) minus that of a process that only did the same imports.

Every figure is the median of --repeats runs, interleaved across variants so that a noisy
neighbour hits them alike. Usage:

    python benchmarks/load.py                      # ~2 GB, T = 1 2 4 8, median of 3
    python benchmarks/load.py --preset reference   # the 777.7 MiB model of BENCHMARKS.md
    python benchmarks/load.py --layers 8 --tp 2,4 --shards 4 --dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"]
                                               .values()))]
    return [folder / "model.safetensors"]


def warm(files: list[Path]) -> None:
    """Read every file once so its pages are in the page cache (the host evicts idle pages)."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as handle:
            while handle.readinto(view):
                pass


# ------------------------------------------------------------------ child processes

CHILD = r'''
import json, os, sys, time
t_start = time.monotonic()
mode, spec = sys.argv[1], json.loads(sys.argv[2])

def rchar():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("rchar")).split()[1])

class Count:
    def __init__(self):
        self.bytes = 0
    def record(self, path, offset, length):
        self.bytes += length

result = {}
if mode in ("loader", "loader-bytes", "loader-base"):
    sys.path.insert(0, spec["build"])
    import importlib
    module = importlib.import_module(spec["module"])
    t_imported = time.monotonic()
    if mode != "loader-base":
        hook = Count() if mode == "loader-bytes" else None
        r0 = rchar()
        t0 = time.monotonic()
        state = module.load(spec["checkpoint"], reader=hook)
        t1 = time.monotonic()
        result.update(seconds=t1 - t0, rchar=rchar() - r0, end=t1,
                      nbytes=sum(a.nbytes for a in state.tensors.values()),
                      hook=hook.bytes if hook else None)
elif mode in ("naive", "naive-base"):
    import numpy as np
    from safetensors.numpy import load_file
    import ml_dtypes  # registers bfloat16
    if mode == "naive":
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
        t1 = time.monotonic()
        result.update(seconds=t1 - t0, end=t1, nbytes=sum(a.nbytes for a in mine.values()))
elif mode in ("floor-read", "floor-readinto", "floor-base"):
    import numpy as np
    if mode != "floor-base":
        t0 = time.monotonic()
        left, chunks = spec["nbytes"], []
        buf = np.empty(spec["nbytes"], np.uint8) if mode == "floor-readinto" else None
        view, done = (memoryview(buf) if buf is not None else None), 0
        for f in spec["files"]:
            with open(f, "rb", buffering=0) as handle:
                while left:
                    if view is not None:
                        got = handle.readinto(view[done:])
                    else:
                        data = handle.read(left)
                        got = len(data)
                        chunks.append(data)
                    if not got:
                        break
                    done += got
                    left -= got
            if not left:
                break
        t1 = time.monotonic()
        result.update(seconds=t1 - t0, end=t1, nbytes=done)
# ru_maxrss would include the parent: Linux folds the mm left behind at exec into it.
with open("/proc/self/status") as f:
    result["maxrss"] = int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps(result))
'''


WORKERS: dict[str, str] = {}


def child_environment() -> dict[str, str]:
    """This environment with bytecode caching on (a deployment imports from .pyc files)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **WORKERS}


def run_child(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(spec)],
                          capture_output=True, text=True, check=False,
                          env=child_environment())
    if proc.returncode:
        raise SystemExit(f"{mode} child failed:\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "end" in result:
        result["from_start"] = result["end"] - start
    return result


# ------------------------------------------------------------------ main


def compile_builds(folder: Path, builds: Path, tps: list[int]) -> dict[int, dict[str, Any]]:
    from partc.api import compile_family
    from partc.emit.render import package_name, rank_module_name

    out = {}
    for tp in tps:
        build = builds / f"tp{tp}"
        result = compile_family("llama", folder / "config.json", tensor_parallel_size=tp,
                                pipeline_parallel_size=1, checkpoint=folder, out=build)
        plan = result.plan
        rank = plan.ranks[0]
        selections = []
        for t in rank.layout.tensors:
            axis, ranges = t.selection
            selections.append([t.target, axis, [list(r) for r in ranges]])
        module = f"{package_name(plan)}.{rank_module_name(0, plan.topology.world_size)}"
        out[tp] = {"build": str(build), "module": module, "checkpoint": str(folder),
                   "local": rank.info.local_parameter_bytes, "selections": selections}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--shards", type=int, default=1, help="checkpoint files (index if > 1)")
    parser.add_argument("--tp", default="1,2,4,8", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="checkpoint folder (kept; reused if present)")
    parser.add_argument("--skip-naive", action="store_true", help="skip the naive baseline")
    parser.add_argument("--workers", type=int, default=None,
                        help="loader threads (PARTC_READ_THREADS; default: one per CPU, max 8)")
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
    print(f"checkpoint: {total / 2**20:.1f} MiB in {len(files)} file(s); hidden "
          f"{config['hidden_size']}, intermediate {config['intermediate_size']}, "
          f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}; rank 0 of each "
          f"TP, median of {args.repeats}; {os.cpu_count()} CPUs; loader threads "
          f"{args.workers or 'default'}", flush=True)

    base = {m: run_child(m, builds[tps[0]])["maxrss"]
            for m in ("loader-base", "naive-base", "floor-base")}
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    variants = ["loader", "floor-read", "floor-readinto"] + ([] if args.skip_naive else
                                                             ["naive"])
    for repeat in range(args.repeats):
        for position, tp in enumerate(tps):
            spec = {**builds[tp], "files": [str(f) for f in files],
                    "nbytes": builds[tp]["local"]}
            # rotate the order: a variant that frees much memory (naive) makes the next
            # process's first touches slower while the host takes the freed pages back
            turn = (repeat + position) % len(variants)
            for mode in variants[turn:] + variants[:turn]:
                warm(files)
                runs.setdefault((tp, mode), []).append(run_child(mode, spec))
    hooks = {}
    for tp in tps:
        warm(files)
        hooks[tp] = run_child("loader-bytes", builds[tp])

    def med(tp: int, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[(tp, mode)])

    rows = []
    for tp in tps:
        local = builds[tp]["local"]
        loader = med(tp, "loader", "seconds")
        floor = min(med(tp, "floor-read", "seconds"), med(tp, "floor-readinto", "seconds"))
        naive = None if args.skip_naive else med(tp, "naive", "seconds")
        rss = med(tp, "loader", "maxrss") - base["loader-base"]
        rows.append({
            "T": tp, "local MiB": local / 2**20, "loader s": loader, "floor s": floor,
            "loader/floor": loader / floor,
            "naive s": naive, "naive/loader": None if naive is None else naive / loader,
            "0.8T": 0.8 * tp,
            "hook bytes/local": hooks[tp]["hook"] / local,
            "rchar/local": med(tp, "loader", "rchar") / local,
            "RSS-base MiB": rss / 2**20, "local+64": local / 2**20 + 64,
            "naive RSS MiB": None if naive is None else
            (med(tp, "naive", "maxrss") - base["naive-base"]) / 2**20,
            "start->last s": med(tp, "loader", "from_start"),
        })
    print_table(rows)
    print(f"\ntransformers from_pretrained(tp_plan='auto'), T=2, BENCHMARKS.md reference model: "
          f"{TRANSFORMERS_T2} s process start to return (not measured here).")
    print(f"interpreter+imports baseline RSS: loader {base['loader-base'] / 2**20:.0f} MiB, "
          f"naive {base['naive-base'] / 2**20:.0f} MiB, floor {base['floor-base'] / 2**20:.0f} MiB")
    verdicts(rows)
    scratch.cleanup()


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = list(rows[0])
    cells = [[fmt(r[k]) for k in keys] for r in rows]
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
            ("bytes <= 1.02x", r["hook bytes/local"] <= 1.02),
            ("time <= 1.5x floor", r["loader/floor"] <= 1.5),
            ("RSS <= local+64MiB", r["RSS-base MiB"] <= r["local+64"]),
        ]
        if r["T"] >= 2 and r["naive/loader"] is not None:
            checks.append((f">= {0.8 * r['T']:.1f}x naive", r["naive/loader"] >= 0.8 * r["T"]))
        print(f"  T={r['T']}: " + ", ".join(f"{n} {'ok' if ok else 'MISSED'}"
                                           for n, ok in checks))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "compiler"))
    main()
