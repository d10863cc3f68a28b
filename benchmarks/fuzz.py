"""Run the Hypothesis fuzzers of tests/test_fuzz.py at full budget and print outcome counts.

    python benchmarks/fuzz.py                 # 12,000 examples, derandomized
    python benchmarks/fuzz.py 20000 --random  # another budget, fresh random examples

Every example must end in a PartcError or a whole build (a traceback fails the run, a failed
compile must leave the previous build byte for byte); the table shows how each target's examples
ended: `ok` or the PartcError subclass (for headers: what `check` and `load()` each said).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    """Run every fuzz target with the given total budget; print counts per outcome."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="?", type=int, default=12_000,
                        help="total examples over all targets (default 12000)")
    parser.add_argument("--random", action="store_true", help="fresh random examples")
    args = parser.parse_args(argv)
    os.environ["PARTC_FUZZ_EXAMPLES"] = str(args.examples)
    if args.random:
        os.environ["PARTC_FUZZ_RANDOM"] = "1"
    sys.path.insert(0, str(ROOT / "tests"))
    import test_fuzz

    tests = [getattr(test_fuzz, name) for name in sorted(dir(test_fuzz))
             if name.startswith("test_")]
    started = time.perf_counter()
    for test in tests:
        began = time.perf_counter()
        test()
        print(f"{test.__name__}: {time.perf_counter() - began:.1f} s", flush=True)
    elapsed = time.perf_counter() - started
    total = 0
    print()
    print(f"{'target':<12} {'outcome':<58} {'count':>7}")
    for target, counts in test_fuzz.OUTCOMES.items():
        for outcome, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
            print(f"{target:<12} {outcome:<58} {count:>7}")
        subtotal = sum(counts.values())
        total += subtotal
        print(f"{target:<12} {'(all)':<58} {subtotal:>7}")
    print(f"\n{total} examples in {elapsed:.0f} s: 0 tracebacks (only PartcError escaped), "
          "0 half-written builds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
