"""The seeing and authoring commands of the command line: inspect, explain, report, init,
families, schema and docs (`partc.cli` parses the arguments and reports errors)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from partc.errors import LoadError, SourceLocation
from partc.runtime.files import file_kind

EXIT_OK = 0
"""Success (cli.parser.EXIT_OK)."""
REPORT_MARKER = "<!-- partc report -->"
"""The first line of every report partc writes: only such a file is ever replaced."""


@contextmanager
def progress(what: str, *, stream: Any = None, interval: float = 0.5) -> Iterator[None]:
    """`partc: <what> ... 3 s` redrawn on a terminal while a long step runs; silent otherwise."""
    out = sys.stderr if stream is None else stream
    if not (out is not None and out.isatty() and "PYTEST_CURRENT_TEST" not in os.environ):
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def draw() -> None:
        while not done.wait(interval):
            out.write(f"\rpartc: {what} ... {time.monotonic() - start:.0f} s")
            out.flush()
    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if time.monotonic() - start >= interval:
            out.write("\r\033[K")
            out.flush()


def _print(lines: list[str]) -> None:
    for line in lines:
        print(line)


def _origins(build: Any, args: argparse.Namespace) -> Any:
    """The family lines of a build's groups: from --family, the built-in family, or the file
    plan.json names found here or in the folder holding the build."""
    from partc.inspect.origins import group_origins

    return group_origins(build.file, args.family, near=build.path.parent.parent)


def _inspect_origins(build: Any, args: argparse.Namespace) -> tuple[Any, str]:
    """The family lines of a build's tensors and how they were found (`_origins`), or none
    and why in an install without the compiler's libraries (numpy and ml_dtypes only, README
    "Serving images"): the lines come from re-binding the family, the table does not."""
    try:
        origins = _origins(build, args)
    except ModuleNotFoundError as exc:
        if exc.name not in ("yaml", "jsonschema", "jinja2"):
            raise
        return None, ("not shown: finding them needs the compiler's libraries, and this "
                      f"install has no {exc.name} module (pip install partc with its "
                      "dependencies)")
    return origins.lines, origins.note


def run_inspect(args: argparse.Namespace) -> int:
    """`partc inspect PATH`: a build's summary or tensor table, or a checkpoint's inventory."""
    from partc.inspect.plan_summary import is_build, read_build, summary, tensor_rows
    from partc.inspect.text import inventory_lines, summary_lines, tensor_lines
    from partc.runtime.manifest import SHARD_MANIFEST

    path = Path(args.path)
    if not path.exists():
        raise LoadError(f"{path} does not exist; expected a build folder, a plan.json or a "
                        "checkpoint", location=SourceLocation(str(path)))
    if path.is_dir() and (path / SHARD_MANIFEST).is_file():
        files = sorted(p.name for p in path.glob("rank-*.safetensors"))
        raise LoadError(f"{path} is a `partc shard` set ({SHARD_MANIFEST} and {len(files)} rank "
                        f"file(s)), not a checkpoint or a build: inspect one rank's file "
                        f"({files[0] if files else 'rank-NN-of-NN.safetensors'}), or the build "
                        "it was cut for", location=SourceLocation(str(path)))
    if not is_build(path):
        from partc.inspect.inventory import inventory

        if args.rank is not None or args.group or args.target:
            raise LoadError(f"{path} is a checkpoint, not a build: --rank, --group and --target "
                            "select the tensors of a build")
        with progress("reading the header"):
            found = inventory(path)
        if args.format == "json":
            print(json.dumps({"ok": True, "kind": "checkpoint"} | found, indent=1))
        else:
            _print(inventory_lines(found))
        return EXIT_OK
    build = read_build(path)
    if args.to is not None:
        return _inspect_transfer(build.file, read_build(args.to).file, args.format)
    if args.rank is not None or args.group or args.target:
        lines, note = _inspect_origins(build, args)
        rows = tensor_rows(build, rank=args.rank, group=args.group, target=args.target,
                           origins=lines)
        if args.format == "json":
            print(json.dumps({"ok": True, "kind": "tensors", "origin_note": note,
                              "tensors": rows}, indent=1))
        else:
            _print(tensor_lines(rows, note))
        return EXIT_OK
    found = summary(build)
    if args.format == "json":
        print(json.dumps({"ok": True, "kind": "build"} | found, indent=1))
    else:
        _print(summary_lines(found))
    return EXIT_OK


def _inspect_transfer(source: Any, destination: Any, form: str) -> int:
    """`partc inspect A --to B`: the transfer plan between two builds."""
    from partc.inspect.transfer_summary import transfer_lines, transfer_summary

    found = transfer_summary(source, destination)
    if form == "json":
        print(json.dumps({"ok": True, "kind": "transfer"} | found, indent=1))
    else:
        _print(transfer_lines(found))
    return EXIT_OK


def run_explain(args: argparse.Namespace) -> int:
    """`partc explain BUILD TARGET`."""
    from partc.inspect.explain import explain
    from partc.inspect.plan_summary import read_build
    from partc.inspect.text import explain_lines

    build = read_build(args.build)
    found = explain(build, args.target, _origins(build, args))
    if args.format == "json":
        print(json.dumps({"ok": True} | found, indent=1))
    else:
        _print(explain_lines(found))
    return EXIT_OK


def write_text_file(out: Path, text: str, *, marker: str | None = None) -> None:
    """Write one file atomically (temporary file, then rename); never replace a file that is
    not partc's (its first line must be `marker`), a folder or a link."""
    if out.is_symlink() or out.is_dir():
        raise LoadError(f"{out} is a {'link' if out.is_symlink() else 'folder'}; expected a "
                        "new file path", location=SourceLocation(str(out)))
    with contextlib.suppress(OSError):  # a FIFO would block the read of its first line
        mode = os.lstat(out).st_mode
        if not stat.S_ISREG(mode):
            raise LoadError(f"{out} is {file_kind(mode)}; expected a new file path (partc "
                            "never replaces a file it did not write)",
                            location=SourceLocation(str(out)))
    if out.exists():
        head = ""
        try:
            with out.open(encoding="utf-8", errors="replace") as handle:
                head = handle.readline().rstrip("\n")
        except OSError:
            pass
        if marker is None or head != marker:
            raise LoadError(f"{out} exists and partc did not write it; choose a new path (partc "
                            "never replaces a file it did not write)",
                            location=SourceLocation(str(out)))
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise LoadError(f"folder {parent} does not exist", location=SourceLocation(str(out)))
    from partc.output import fitting_name

    # `.NAME.` and mkstemp's 8 letters: a long NAME is shortened so the scratch name is valid.
    scratch = ""
    try:
        descriptor, scratch = tempfile.mkstemp(prefix=f".{fitting_name(out.name, 10)}.",
                                               dir=parent)
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.chmod(scratch, 0o644)
        os.replace(scratch, out)
    except OSError as exc:  # named as the file asked for, not the hidden scratch file
        if scratch:
            Path(scratch).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(out)) from None
    except BaseException:
        if scratch:
            Path(scratch).unlink(missing_ok=True)
        raise


def run_report(args: argparse.Namespace) -> int:
    """`partc report BUILD --out report.html`."""
    from partc.inspect.html_report import render_report
    from partc.inspect.plan_summary import read_build

    build = read_build(args.build)
    if args.to is not None:
        from partc.inspect.transfer_summary import render_transfer_report, transfer_summary

        html = render_transfer_report(transfer_summary(build.file, read_build(args.to).file))
    else:
        html = render_report(build, _origins(build, args))
    out = Path(args.out)
    write_text_file(out, html, marker=REPORT_MARKER)
    if args.format == "json":
        print(json.dumps({"ok": True, "out": str(out), "bytes": len(html.encode())}, indent=1))
    else:
        print(f"wrote {out} ({len(html.encode())} bytes): open it in a browser; it needs no "
              "network")
    return EXIT_OK


def config_beside(checkpoint: Path) -> Path:
    """Where a checkpoint's config.json is: in its folder, or beside its file (a .safetensors
    file or an index), as Hugging Face saves them; init, compile and check use it."""
    return (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "config.json"


def verify_failures(family: Path, config: Path, sizes: Sequence[int]
                    ) -> list[tuple[str, str]]:
    """`partc verify` of a family at T = `sizes` (S = 1): each failing check's (group,
    message); what `partc init --prove` decides by."""
    from partc.verify.run import verify_family

    report = verify_family(family, config, tensor_parallel_sizes=sizes,
                           pipeline_parallel_size=1)
    return [(check.group, check.message) for check in report.checks if not check.ok]


def verify_cut_failures(family: Path, config: Path, stages: int) -> list[tuple[str, str]]:
    """`partc verify` of a family at T = 1 and S = `stages`: each failing check's (group,
    message); what `partc init --prove` decides a placeholder boundary by."""
    from partc.verify.run import verify_family

    report = verify_family(family, config, tensor_parallel_sizes=[1],
                           pipeline_parallel_size=stages)
    return [(check.group, check.message) for check in report.checks if not check.ok]


def run_init(args: argparse.Namespace) -> int:
    """`partc init --checkpoint DIR [--config FILE] [--out FILE] [--prove]`."""
    from partc.scaffold.family_text import scaffold

    checkpoint = Path(args.checkpoint)
    config = Path(args.config) if args.config else config_beside(checkpoint)
    if args.prove:
        from partc.scaffold.prove import prove

        result = prove(checkpoint, config, verify_failures, name=args.name,
                       progress=None if args.format == "json" else
                       lambda line: print(f"prove: {line}", file=sys.stderr),
                       pipeline=verify_cut_failures)
    else:
        result = scaffold(checkpoint, config, name=args.name)
    if args.out:
        write_text_file(Path(args.out), result.text)
    if args.format == "json":
        print(json.dumps({"ok": True, "out": args.out, "text": result.text,
                          "undecided": list(result.undecided), "notes": list(result.notes)},
                         indent=1))
        return EXIT_OK
    if args.out:
        print(f"wrote {args.out}: {len(result.undecided)} line(s) marked `# partc init: CHECK`;"
              f" next: partc check {args.out} --checkpoint {args.checkpoint}")
    else:
        sys.stdout.write(result.text)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return EXIT_OK


def run_families(args: argparse.Namespace) -> int:
    """`partc families`: the built-in families, their model types and files; `--copy`."""
    from partc.library import builtin_families

    root = resources.files("partc.architectures")
    if args.copy:
        name, target = args.copy
        files = builtin_families()
        if name not in files:
            raise LoadError(f"no built-in family {name!r}; known: {', '.join(sorted(files))}")
        from partc.scaffold.family_text import SCHEMA_COMMENT

        text = root.joinpath(files[name]).read_text(encoding="utf-8")
        if text.startswith(SCHEMA_COMMENT):  # the built-in's line is relative to the library
            text = SCHEMA_COMMENT + schema_path().resolve().as_uri() + text[text.index("\n"):]
        write_text_file(Path(target), text)
        if args.format == "json":
            print(json.dumps({"ok": True, "copied": files[name], "out": target}))
        else:
            print(f"copied architectures/{files[name]} to {target}; check it with "
                  f"`partc check {target}`")
        return EXIT_OK
    entries = [{"model_type": t, "file": f, "path": str(Path(str(root.joinpath(f))).resolve())}
               for t, f in sorted(builtin_families().items())]
    if args.format == "json":
        print(json.dumps({"ok": True, "families": entries}, indent=1))
    else:
        for entry in entries:  # absolute paths: --format json, or `partc families --copy`
            print(f"{entry['model_type']:<20} architectures/{entry['file']}")
    return EXIT_OK


def schema_path() -> Path:
    """The installed family JSON Schema."""
    return Path(str(resources.files("partc.schemas").joinpath("architecture.schema.json")))


def run_schema(args: argparse.Namespace) -> int:
    """`partc schema [--path]`; `--format json` gives {"path", "schema"} (the schema parsed,
    left out under --path)."""
    path = schema_path()
    if args.format == "json":
        found: dict[str, Any] = {"ok": True, "path": str(path)}
        if not args.path:
            found["schema"] = json.loads(path.read_text(encoding="utf-8"))
        print(json.dumps(found, indent=1))
    elif args.path:
        print(path)
    else:
        sys.stdout.write(path.read_text(encoding="utf-8"))
    return EXIT_OK


def docs_folder() -> Path:
    """Where the installed guides are: the `partc.docs` package data of the wheel."""
    return Path(str(resources.files("partc.docs")))


def doc_topics() -> tuple[str, ...]:
    """The installed guides' topics: their file names without `.md`, sorted, then the family
    notes as `families/NAME`."""
    folder = docs_folder()
    return (tuple(sorted(p.stem for p in folder.glob("*.md")))
            + tuple(sorted(f"families/{p.stem}" for p in (folder / "families").glob("*.md"))))


def heading_anchor(heading: str) -> str:
    """The anchor of a Markdown heading as GitHub spells it: `## 3. Parameter groups` gives
    `3-parameter-groups` (lower case, punctuation dropped, spaces to hyphens)."""
    text = heading.lstrip("#").strip().lower()
    return "".join(c for c in text.replace(" ", "-") if c.isalnum() or c in "-_")


def _headings(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line, text) of each Markdown heading of a guide (fenced code is not one)."""
    fenced = False
    for number, line in enumerate(text.split("\n"), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            yield number, line


def doc_sections(path: Path) -> dict[str, int]:
    """Each heading anchor of a guide and its 1-based line (fenced code is not a heading)."""
    sections: dict[str, int] = {}
    for number, line in _headings(path.read_text(encoding="utf-8")):
        sections.setdefault(heading_anchor(line), number)
    return sections


def doc_title(path: Path) -> str:
    """A guide's title: the text of its first heading (its file name when it has none)."""
    for _, line in _headings(path.read_text(encoding="utf-8")):
        return line.lstrip("#").strip()
    return path.stem


def doc_text(topic: str) -> str:
    """What `partc docs TOPIC` prints: the installed guide, or for `page#section` that
    section, from its heading up to the next heading of the same or a higher level."""
    path = docs_path(topic)
    text = path.read_text(encoding="utf-8")
    if not topic.partition("#")[2]:
        return text
    start = int(doc_reference(topic).rpartition(":")[2])  # 1-based; a LoadError when unknown
    lines = text.split("\n")
    level = len(lines[start - 1]) - len(lines[start - 1].lstrip("#"))
    stop = next((n for n, line in _headings(text)
                 if n > start and len(line) - len(line.lstrip("#")) <= level), len(lines) + 1)
    return "\n".join(lines[start - 1:stop - 1]).rstrip("\n") + "\n"


def docs_path(topic: str | None = None) -> Path:
    """Where an installed guide is (the folder when `topic` is None); `TOPIC#section` names a
    section of it."""
    if topic is None:
        return docs_folder()
    page = topic.partition("#")[0].removesuffix(".md")
    if page not in doc_topics():
        raise LoadError(f"no guide {page!r}; the guides are {', '.join(doc_topics())}")
    return docs_folder() / f"{page}.md"


def doc_reference(topic: str) -> str:
    """What an error's `see:` hint and `partc docs TOPIC` print: the installed guide's path, and
    `:LINE` of the section for `page#section`, so that an editor or terminal opens it there."""
    path = docs_path(topic)
    section = topic.partition("#")[2]
    if not section:
        return str(path)
    line = doc_sections(path).get(section)
    if line is None:
        raise LoadError(f"guide {path.stem!r} has no section {section!r}; its sections are "
                        f"{', '.join(doc_sections(path))}")
    return f"{path}:{line}"


def error_reference(topic: str | None) -> str | None:
    """An error's `see:` hint, or None when it names no guide, or one that is not installed
    (a hint never fails the report it belongs to)."""
    if topic is None:
        return None
    try:
        return doc_reference(topic)
    except (LoadError, OSError):
        return None


def _doc_index() -> list[dict[str, Any]]:
    """Every installed guide: its topic, path, title and sections (anchor and line)."""
    return [{"topic": topic, "path": str(docs_path(topic)), "title": doc_title(docs_path(topic)),
             "sections": [{"anchor": anchor, "line": line}
                          for anchor, line in doc_sections(docs_path(topic)).items()]}
            for topic in doc_topics()]


def _show(text: str) -> None:
    """Write a guide to stdout: through the pager ($PAGER, else `less`) on a terminal."""
    if sys.stdout.isatty() and sys.stdin.isatty():
        import pydoc

        pydoc.pager(text)
    else:
        sys.stdout.write(text)


def run_docs(args: argparse.Namespace) -> int:
    """`partc docs [TOPIC[#section]]`: print the installed guide (the section of it), or with
    `--path` where it is (`:LINE` for a section); without a TOPIC, the guides' titles; with
    `--list`, every topic (or TOPIC) and its sections."""
    fmt = getattr(args, "format", "text")
    if args.list or (args.topic is None and not args.path):
        index = _doc_index()
        if args.topic is not None:  # --list TOPIC: that guide's sections
            page = docs_path(args.topic).relative_to(docs_folder()).with_suffix("").as_posix()
            index = [g for g in index if g["topic"] == page]
        if fmt == "json":
            print(json.dumps({"ok": True, "folder": str(docs_folder()), "guides": index},
                             indent=1))
        elif args.list:
            for guide in index:
                print(guide["topic"])
                for section in guide["sections"]:
                    print(f"  {guide['topic']}#{section['anchor']}")
        else:
            width = max(len(g["topic"]) for g in index)
            _print([f"{g['topic']:<{width}}  {g['title']}" for g in index] + [
                "", "partc docs TOPIC prints a guide (TOPIC#section: a section of it); "
                "--list lists the sections; --path prints where a guide is"])
        return EXIT_OK
    if args.topic is None:  # --path alone: the folder
        print(json.dumps({"ok": True, "path": str(docs_folder())}, indent=1) if fmt == "json"
              else docs_folder())
        return EXIT_OK
    reference = doc_reference(args.topic)
    path, _, line = reference.rpartition(":") if "#" in args.topic else (reference, "", "")
    if fmt == "json":
        found: dict[str, Any] = {"ok": True, "topic": args.topic, "path": path,
                                 "line": int(line) if line else None}
        if not args.path:
            found["text"] = doc_text(args.topic)
        print(json.dumps(found, indent=1))
    elif args.path:
        print(reference)
    else:
        _show(doc_text(args.topic))
    return EXIT_OK
