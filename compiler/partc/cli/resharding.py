"""The resharding commands of the command line: reshard and merge, with their text and JSON
reports."""

from __future__ import annotations

import argparse
import json

from partc.cli.compiling import _progress_enabled, shard_set_report
from partc.cli.parser import EXIT_OK


def run_reshard(args: argparse.Namespace) -> int:
    """`partc reshard`: the shard set of one build rewritten for another."""
    from partc.reshard import reshard_shards
    from partc.runtime.progress import terminal_progress

    with terminal_progress(_progress_enabled(args)) as report:
        result = reshard_shards(args.source, args.shards, args.destination, args.out,
                                force=args.force, progress=False, report=report)
    return shard_set_report(args.format, f"resharded {args.shards}", result)


def run_merge(args: argparse.Namespace) -> int:
    """`partc merge`: the Hugging Face checkpoint written back from a shard set."""
    from partc.reshard import merge_shards

    result = merge_shards(args.shards, args.build, args.out, force=args.force)
    if args.format == "json":
        print(json.dumps({"ok": True, "out": str(result.out), "files": list(result.files),
                          "bytes": result.nbytes}, indent=1))
        return EXIT_OK
    print(f"merged {args.shards} into {result.out}: {', '.join(result.files)}, "
          f"{result.nbytes / 2**20:.1f} MiB")
    return EXIT_OK
