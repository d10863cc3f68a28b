"""The `partc init --prove` table: for every tiny fixture checkpoint, the proven scaffold's
checks, verification and split against the built-in family of its model type.

    .venv/bin/python scripts/init_prove_table.py [--fixture NAME ...] [--out DIR] [--json FILE]

Per fixture (`tests/fixtures/hf/*`, `tests/fixtures/quantized/*` and `../shared/fixtures/hf/*`;
a shared checkpoint byte-identical to a tests one is listed once): the scaffold `partc init
--prove` writes, its CHECK lines, the layouts it decided, the T <= 4 at which it checks
(`partc check --tp T`) beside the built-in's, whether `partc verify` accepts it at all of those
(S = 2 where it compiles), and at each T both compile at, the share of the checkpoint's
elements the T ranks read together (`partc.scaffold.prove.read_share`: 1.0 everything split
once, T everything replicated), scaffold vs built-in.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
import time
from pathlib import Path
from typing import Any

from partc.api import check_family, plan_family
from partc.cli.commands import verify_cut_failures, verify_failures
from partc.errors import PartcError
from partc.plan.topology import Topology
from partc.scaffold.prove import prove, read_share

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 2, 3, 4)


def fixtures() -> dict[str, Path]:
    """Every tiny fixture checkpoint by name, shared ones byte-identical to a tests one once."""
    found = {p.name: p for folder in ("hf", "quantized")
             for p in sorted((ROOT / "tests" / "fixtures" / folder).iterdir())
             if (p / "config.json").is_file() and (p / "model.safetensors").is_file()}
    shared = ROOT.parent / "shared" / "fixtures" / "hf"
    for p in sorted(shared.iterdir()) if shared.is_dir() else ():
        mine = found.get(p.name)
        if (p / "model.safetensors").is_file() and not (mine is not None and all(
                filecmp.cmp(p / f, mine / f, shallow=False)
                for f in ("model.safetensors", "config.json"))):
            found[f"shared/{p.name}"] = p
    return found


def legal(family: Path | None, checkpoint: Path) -> list[int]:
    """The T <= 4 at which the family checks against the checkpoint."""
    return [tp for tp in SIZES if not check_family(
        family, checkpoint / "config.json", checkpoint,
        topology=Topology(tensor_parallel_size=tp))]


def row(name: str, checkpoint: Path, out: Path) -> dict[str, Any]:
    """One fixture's entry of the table."""
    from partc.verify.run import verify_family

    config = checkpoint / "config.json"
    start = time.perf_counter()
    result = prove(checkpoint, config, verify_failures, pipeline=verify_cut_failures)
    proved = time.perf_counter() - start
    family = out / f"{name.replace('/', '_')}.yaml"
    family.write_text(result.text, encoding="utf-8")
    entry: dict[str, Any] = {
        "fixture": name, "check_lines": len(result.undecided), "prove_seconds": round(proved, 1),
        "decided": [line.split("--prove: ", 1)[1].split(": verified")[0] for line in
                    result.text.splitlines() if "# partc init --prove:" in line],
        "scaffold_tp": legal(family, checkpoint), "builtin_tp": [], "verify": None,
        "shares": {}}
    try:
        entry["builtin_tp"] = legal(None, checkpoint)
    except PartcError as error:
        entry["builtin_tp"] = f"no built-in: {str(error).splitlines()[0][:80]}"
    if entry["scaffold_tp"]:
        try:
            report = verify_family(family, config, tensor_parallel_sizes=entry["scaffold_tp"])
            failed = [c for c in report.checks if not c.ok]
            entry["verify"] = "ok" if not failed else " ".join(failed[0].message.split())[:160]
        except PartcError as error:
            entry["verify"] = "error: " + " ".join(str(error).split())[:160]
    for tp in entry["scaffold_tp"]:
        if isinstance(entry["builtin_tp"], list) and tp in entry["builtin_tp"]:
            topology = Topology(tensor_parallel_size=tp)
            entry["shares"][tp] = [round(read_share(plan_family(f, config, topology,
                                                                checkpoint=checkpoint)), 4)
                                   for f in (family, None)]
    entry["seconds"] = round(time.perf_counter() - start, 1)
    return entry


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown."""
    lines = ["| fixture | decided by --prove | CHECK lines | T checks (scaffold / built-in) "
             "| verify | elements read / total at T (scaffold vs built-in) | s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        shares = ", ".join(f"T={tp}: {a}" + (" =" if a == b else f" vs {b}")
                           for tp, (a, b) in r["shares"].items())
        builtin = r["builtin_tp"] if isinstance(r["builtin_tp"], str) else \
            ",".join(map(str, r["builtin_tp"]))
        lines.append(f"| {r['fixture']} | {'; '.join(r['decided']) or '-'} | "
                     f"{r['check_lines']} | {','.join(map(str, r['scaffold_tp']))} / "
                     f"{builtin} | {r['verify']} | {shares} | {r['seconds']} |")
    return "\n".join(lines)


def main() -> int:
    """Write the table (stdout) and, with --json, its data."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", action="append", help="only these fixtures (by name)")
    parser.add_argument("--out", default=None, help="where the scaffolds are written")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    found = fixtures()
    names = args.fixture or sorted(found)
    out = Path(args.out) if args.out else Path.cwd() / "init_prove_scaffolds"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(row(name, found[name], out))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
