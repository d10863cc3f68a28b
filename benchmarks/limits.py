"""Measure how long the documented maxima take to compile from the command line.

Two inputs sit exactly at partc's bounds:

- the tiny Llama of tests/fixtures/hf/llama with `num_hidden_layers` = `partc.bind.MAX_UNITS`;
- the tiny Mixtral with as many experts as `partc.bind.MAX_GROUP_INSTANCES` allows (every
  expert of every layer is one parameter-group instance).

Each is compiled with `partc compile ... --out` in a fresh process (interpreter start included)
at TP=1 x PP=1 and TP=2 x PP=2; the median of the repeats is printed. Usage:

    python benchmarks/limits.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
TOPOLOGIES = ((1, 1), (2, 2))


def llama_at_max_units(folder: Path) -> tuple[str, Path]:
    """The tiny Llama config with MAX_UNITS decoder layers."""
    from partc.bind.binder import MAX_UNITS

    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    config["num_hidden_layers"] = MAX_UNITS
    path = folder / "llama.json"
    path.write_text(json.dumps(config, indent=1))
    return f"llama, {MAX_UNITS} layers", path


def mixtral_at_max_instances(folder: Path) -> tuple[str, Path]:
    """The tiny Mixtral config with as many experts per layer as MAX_GROUP_INSTANCES allows."""
    from partc.api import bind
    from partc.bind.binder import MAX_GROUP_INSTANCES
    from partc.errors import PartcError

    base = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
    path = folder / "mixtral.json"

    def groups(layers: int, experts: int) -> int:
        path.write_text(json.dumps({**base, "num_hidden_layers": layers,
                                    "num_local_experts": experts}, indent=1))
        return len(bind(None, path)[0].description.groups)

    per_layer = groups(2, 1) - groups(1, 1) - 1  # a layer's groups besides its experts
    fixed = groups(1, 1) - per_layer - 1  # the groups outside the layers
    layers = 64
    experts = (MAX_GROUP_INSTANCES - fixed) // layers - per_layer
    while True:  # the instance count also holds instances a `when` skips: step down to fit
        try:
            count = groups(layers, experts)
            break
        except PartcError:
            experts -= 1
    return f"mixtral, {layers} layers x {experts} experts ({count} groups)", path


def time_compile(config: Path, tp: int, pp: int, out: Path) -> float:
    """Wall-clock seconds of one `partc compile` in a fresh process."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "partc.cli", "compile", "--config", str(config),
                    "--tp", str(tp), "--pp", str(pp), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Print the median compile time of each input at each topology."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="partc-limits-") as scratch:
        folder = Path(scratch)
        for make in (llama_at_max_units, mixtral_at_max_instances):
            label, config = make(folder)
            for tp, pp in TOPOLOGIES:
                times = [time_compile(config, tp, pp, folder / "build")
                         for _ in range(args.repeats)]
                print(f"{label:<55} TP={tp} x PP={pp}: {statistics.median(times):6.2f} s "
                      f"(median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
