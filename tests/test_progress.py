"""Progress of long compiles, checks and shards: drawn on stderr only when it is a terminal (a
pseudo-terminal here), advancing to completion, cleared at the end; never off a terminal,
under --format json or --quiet; and never changing what is written."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import struct
import sys
import termios
import threading
from pathlib import Path

import pytest

from partc.cli.main import main
from partc.runtime.progress import TerminalProgress, terminal_progress

from support import hf

COMPILE_STEPS = ["bind groups", "realize groups", "render modules", "write files"]
PLAIN = re.compile(r"partc: (?P<step>.+?) (?P<done>[\d.]+)/(?P<total>[\d.]+)(?: (?P<unit>\S+))?"
                   r"(?: \(\d+%\))?$")
TQDM = re.compile(r"partc: (?P<step>.+?):\s+\d+%\|.*?\| (?P<done>[\d.]+\w?)/(?P<total>[\d.]+\w?) ")


def _on_terminal(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str], *, tqdm: bool = True
                 ) -> tuple[int, str, str]:
    """Run the command line with stderr on a pseudo-terminal of 100 columns (and without tqdm
    unless `tqdm`); its status, stdout and every byte the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side is closed
                return
            if not data:
                return
            chunks.append(data)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    terminal = open(slave, "w", encoding="utf-8")  # closed below, after the run
    capsys.readouterr()
    with monkeypatch.context() as patch:
        if not tqdm:
            patch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError
        patch.setattr(sys, "stderr", terminal)
        try:
            status = main(argv)
        finally:
            terminal.close()
    reader.join(timeout=30)
    os.close(master)
    return status, capsys.readouterr().out, b"".join(chunks).decode("utf-8", "replace")


def _off_terminal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _drawings(err: str, pattern: re.Pattern[str]) -> list[tuple[str, str, str]]:
    """Every (step, done, total) drawn, in order (segments between carriage returns)."""
    found = []
    for segment in re.split(r"[\r\n]", err):
        match = pattern.search(segment.rstrip())
        if match:
            found.append((match["step"], match["done"], match["total"]))
    return found


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _compile_argv(out: Path, *extra: str) -> list[str]:
    return ["compile", "--config", str(hf("llama") / "config.json"), "--tp", "2", "--pp", "2",
            "--out", str(out), *extra]


def test_compile_on_a_terminal_without_tqdm_draws_every_step_to_completion_then_clears(
        tmp_path, monkeypatch, capsys):
    status, out, err = _on_terminal(_compile_argv(tmp_path / "build"), monkeypatch, capsys,
                                    tqdm=False)
    assert status == 0, err
    drawn = _drawings(err, PLAIN)
    steps = [step for step, _, _ in drawn]
    assert [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s] == COMPILE_STEPS
    for step in COMPILE_STEPS:
        mine = [(int(d), int(t)) for s, d, t in drawn if s == step]
        assert mine[0][0] == 0 and mine[-1][0] == mine[-1][1] > 0, (step, mine)
        assert [d for d, _ in mine] == sorted(d for d, _ in mine)  # only ever advances
    assert ("render modules", "4", "4") in drawn  # one module per rank of TP=2 x PP=2
    written = len(_files(tmp_path / "build")) - 1  # the rendered files, not the marker
    assert ("write files", str(written), str(written)) in drawn
    assert err.endswith("\r") and err.rsplit("\r", 2)[-2].strip() == ""  # cleared at the end
    assert out.startswith("compiled llama (llama) for TP=2 x PP=2")


def test_compile_on_a_terminal_with_tqdm_draws_bars_that_reach_their_totals(
        tmp_path, monkeypatch, capsys):
    import tqdm  # a dependency of partc (the runtime imports it lazily)

    assert tqdm.__version__
    status, _, err = _on_terminal(_compile_argv(tmp_path / "build"), monkeypatch, capsys)
    assert status == 0, err
    drawn = _drawings(err, TQDM)
    for step in COMPILE_STEPS:
        mine = [(d, t) for s, d, t in drawn if s == step]
        assert mine and mine[-1][0] == mine[-1][1], (step, mine)
    assert "100%" in err


def test_the_same_build_is_written_with_and_without_a_terminal_and_stderr_is_clean_off_one(
        tmp_path, monkeypatch, capsys):
    status, plain_out, plain_err = _off_terminal(_compile_argv(tmp_path / "a"), capsys)
    assert status == 0 and plain_err == ""
    status, tty_out, _ = _on_terminal(_compile_argv(tmp_path / "b"), monkeypatch, capsys)
    assert status == 0
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert tty_out == plain_out.replace(str(tmp_path / "a"), str(tmp_path / "b"))


def test_json_output_and_quiet_draw_nothing_on_a_terminal_and_json_is_unchanged(
        tmp_path, monkeypatch, capsys):
    argv = _compile_argv(tmp_path / "a", "--format", "json")
    status, plain, plain_err = _off_terminal(argv, capsys)
    assert status == 0 and plain_err == ""
    status, tty, err = _on_terminal(argv, monkeypatch, capsys)
    assert status == 0 and err == ""
    assert json.loads(tty) == json.loads(plain)
    status, _, err = _on_terminal(_compile_argv(tmp_path / "a", "--quiet"), monkeypatch, capsys)
    assert status == 0 and err == ""


def test_check_draws_its_steps_and_an_error_comes_after_a_cleared_line(monkeypatch, capsys):
    argv = ["check", "--config", str(hf("llama") / "config.json"), "--tp", "3"]
    status, _, err = _on_terminal(argv, monkeypatch, capsys, tqdm=False)
    assert status == 1
    assert [s for s, _, _ in _drawings(err, PLAIN)][0] == "bind groups"
    assert ("realize groups", "0", "15") in _drawings(err, PLAIN)
    progress, report = err.split("error: ", 1)
    assert progress.endswith("\r") and progress.rsplit("\r", 2)[-2].strip() == ""
    assert report.startswith("architectures/llama.yaml:") and "partc: 1 error(s)" in report


def test_shard_on_a_terminal_reports_the_bytes_written_to_every_rank_file(
        tmp_path, monkeypatch, capsys):
    build, shards = tmp_path / "build", tmp_path / "shards"
    assert _off_terminal(_compile_argv(build), capsys)[0] == 0
    argv = ["shard", str(build), "--checkpoint", str(hf("llama")), "--out", str(shards)]
    status, out, err = _on_terminal(argv, monkeypatch, capsys, tqdm=False)
    assert status == 0, err
    assert out.startswith("sharded ")
    drawn = _drawings(err, PLAIN)
    files = sorted(p for p in shards.glob("*.safetensors"))
    assert len(files) == 4
    for path in files:
        raw = path.read_bytes()
        payload = len(raw) - 8 - int.from_bytes(raw[:8], "little")  # bytes after the header
        assert 1024 <= payload < 1 << 20  # so the line counts KiB
        mine = [(d, t) for s, d, t in drawn if s == f"write {path.name}"]
        assert mine[0][0] == "0.0" and mine[-1] == (f"{payload / 1024:.1f}",) * 2, mine
    status, _, err = _off_terminal([*argv, "--force"], capsys)
    assert status == 0 and err == ""


def test_the_plain_line_shows_bytes_in_binary_units_and_never_outgrows_the_terminal():
    stream = io.StringIO()
    progress = TerminalProgress(stream, use_tqdm=False)
    progress("write rank-00-of-02.safetensors", 3 << 19, 4 << 20, unit="B")
    progress("write rank-00-of-02.safetensors", 4 << 20, 4 << 20, unit="B")
    progress.close()
    lines = stream.getvalue().split("\r")
    assert lines[1] == "partc: write rank-00-of-02.safetensors 1.5/4.0 MiB (37%)"
    assert lines[2] == "partc: write rank-00-of-02.safetensors 4.0/4.0 MiB (100%)"
    assert lines[3].strip() == "" and lines[-1] == ""


def test_no_progress_is_drawn_on_a_stream_that_is_not_a_terminal():
    with terminal_progress(stream=io.StringIO()) as report:
        assert report is None
    with terminal_progress(enabled=False) as report:
        assert report is None
    stream = io.StringIO()
    with terminal_progress(enabled=True, stream=stream) as report:
        assert report is not None
        report("bind groups", 1, 1)
    assert "bind groups" in stream.getvalue() and "1/1" in stream.getvalue()
