"""The command line's first day: `python -m partc`, shell completion (driven in bash and zsh),
`--format json` on demo, schema and docs, `partc docs TOPIC` printing the guide, byte sizes at
the unit boundaries, the pointer from an unknown model_type to `partc init`, demo's stated
limits, and inspect in an install without the compiler's libraries."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from partc.cli.commands import docs_folder
from partc.cli.main import main
from partc.cli.parser import build_parser
from partc.inspect.plan_summary import byte_text

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "compiler" / "partc" / "examples" / "tiny-llama"
SCRIPT = Path(sys.executable).parent / "partc"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _python_m(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "partc", *argv], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)


# ------------------------------------------------------------------ python -m partc


def test_python_m_partc_prints_the_same_help_as_the_partc_script():
    module = _python_m("--help")
    script = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert module.returncode == 0 and script.returncode == 0, module.stderr
    assert module.stdout == script.stdout
    assert module.stdout.startswith("usage: partc ")
    assert _python_m("--version").stdout == f"partc {__import__('partc').__version__}\n"


def test_python_m_partc_runs_a_real_command(tmp_path):
    done = _python_m("demo", "--tp", "2", "--pp", "1", "--out", str(tmp_path / "b"),
                     "--format", "json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert [r["rank"] for r in found["ranks"]] == [0, 1]
    assert (tmp_path / "b" / "plan.json").is_file()
    wrong = _python_m("compile", "--tp", "0", "--out", str(tmp_path / "c"))
    assert wrong.returncode == 2 and "usage: partc compile" in wrong.stderr


# ------------------------------------------------------------------ completion

BASH_DRIVER = r"""
source "$1"
shift
COMP_WORDS=("$@")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
COMP_LINE="${COMP_WORDS[*]}"
COMP_POINT=${#COMP_LINE}
COMPREPLY=()
complete -p partc >/dev/null || exit 3
function=$(complete -p partc | sed -n 's/.* -F \([^ ]*\) .*/\1/p')
"$function" partc "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
"""


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    done = _python_m("completion", "bash")
    assert done.returncode == 0, done.stderr
    path = tmp_path_factory.mktemp("completion") / "partc.bash"
    path.write_text(done.stdout)
    return path


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    (tmp_path / "fam.yaml").write_text("family: x\n")
    (tmp_path / "outdir").mkdir()
    return tmp_path


def _bash_complete(script: Path, words: list[str], cwd: Path) -> set[str]:
    driver = cwd / "driver.sh"
    driver.write_text(BASH_DRIVER)
    done = subprocess.run(["bash", "--norc", "--noprofile", str(driver), str(script), *words],
                          capture_output=True, text=True, timeout=60, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def _commands() -> dict[str, object]:
    import argparse

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_bash_completes_commands_options_choices_families_and_files(bash_script, work):
    subprocess.run(["bash", "-n", str(bash_script)], check=True, timeout=60)
    commands = _commands()
    assert _bash_complete(bash_script, ["partc", "comp"], work) == {
        c for c in commands if c.startswith("comp")} == {"compile", "completion"}
    compile_options = {o for a in commands["compile"]._actions  # type: ignore[attr-defined]
                       for o in a.option_strings}
    assert _bash_complete(bash_script, ["partc", "compile", "--t"], work) == {
        o for o in compile_options if o.startswith("--t")} == {"--tp"}
    assert _bash_complete(bash_script, ["partc", "compile", "--format", ""], work) == {
        "text", "json"}
    assert _bash_complete(bash_script, ["partc", "compile", "ll"], work) == {"llama", "llava"}
    assert _bash_complete(bash_script, ["partc", "check", "fa"], work) == {"falcon", "fam.yaml"}
    assert _bash_complete(bash_script, ["partc", "inspect", "fa"], work) == {"fam.yaml"}
    assert _bash_complete(bash_script, ["partc", "compile", "--out", "ou"], work) == {"outdir"}
    assert _bash_complete(bash_script, ["partc", "docs", "kv"], work) == {"kv_replication"}
    assert _bash_complete(bash_script, ["partc", "completion", ""], work) == {"bash", "zsh"}
    assert _bash_complete(bash_script, ["partc", ""], work) == set(commands)


ZSH_DRIVER = r"""
zmodload zsh/zpty || exit 3
zpty z zsh -f -i
zpty -w z "PROMPT='> '; fpath=($1 \$fpath); autoload -U compinit; compinit -u -D"
capture='compadd () { if [[ ${@[1,(i)(-|--)]} == *-(O|A|D)\ * ]]; then builtin compadd "$@"; '
capture+='return $?; fi; typeset -a __hits; builtin compadd -A __hits "$@"; '
capture+='print -rl -- "<<HI""T>>"${^__hits}; }'
zpty -w z "$capture"
zpty -w z 'comppostfuncs=(__done); __done () { print "<<DO""NE>>" }'
zpty -n -w z "$2"$'\t'
integer tries=0
while (( tries++ < 600 )); do
  if zpty -r -t z line; then
    [[ $line == *'<<DONE>>'* ]] && break
    [[ $line == *'<<HIT>>'* ]] && print -r -- "${${line##*<<HIT>>}%%[$'\r\n']*}"
  else
    sleep 0.05
  fi
done
zpty -d z
(( tries < 600 ))
"""


def test_zsh_completes_through_compinit(work):
    assert shutil.which("zsh"), "zsh is not installed (apt-get install zsh; .ci/run installs it)"
    done = _python_m("completion", "zsh")
    assert done.returncode == 0 and done.stdout.startswith("#compdef partc"), done.stderr
    functions = work / "functions"
    functions.mkdir()
    (functions / "_partc").write_text(done.stdout)
    subprocess.run(["zsh", "-n", str(functions / "_partc")], check=True, timeout=60)
    driver = work / "driver.zsh"
    driver.write_text(ZSH_DRIVER)

    def complete(line: str) -> set[str]:
        found = subprocess.run(["zsh", "-f", str(driver), str(functions), line],
                               capture_output=True, text=True, timeout=120, cwd=work)
        assert found.returncode == 0, found.stderr
        return set(found.stdout.split())

    assert complete("partc comp") == {"compile", "completion"}
    assert complete("partc compile --t") == {"--tp"}
    assert complete("partc compile --format ") == {"text", "json"}
    assert complete("partc compile fa") == {"falcon", "fam.yaml"}
    assert complete("partc compile --out ou") == {"outdir"}


# ------------------------------------------------------------------ --format json


def test_every_command_that_prints_data_takes_format_json():
    for name, parser in _commands().items():
        options = {o for a in parser._actions for o in a.option_strings}  # type: ignore[attr-defined]
        assert ("--format" in options) == (name != "completion"), name


def test_demo_json_gives_every_rank_and_what_loading_it_returned(tmp_path, capsys):
    status, out, _ = _run(["demo", "--format", "json", "--out", str(tmp_path / "b")], capsys)
    found = json.loads(out)
    layers = json.loads((TINY / "config.json").read_text())["num_hidden_layers"]
    assert status == 0 and found["ok"] and found["layers"] == layers
    assert found["out"] == str(tmp_path / "b")
    assert [(r["tensor_parallel_rank"], r["pipeline_stage"]) for r in found["ranks"]] == [
        (0, 0), (1, 0), (0, 1), (1, 1)]
    for stage in (0, 1):  # the stages' units cover the layers, each TP rank the same ones
        units = {json.dumps(r["units"]) for r in found["ranks"] if r["pipeline_stage"] == stage}
        assert len(units) == 1
    assert [u["start"] for r in found["ranks"][::2] for u in r["units"]] == [0, 2]
    assert found["ranks"][-1]["units"][0]["stop"] == layers
    for rank in found["ranks"]:
        assert rank["loaded_arrays"] == rank["tensors"]
        assert rank["loaded_bytes"] == rank["local_bytes"]
    with safe_open(str(TINY / "model.safetensors"), "np") as f:  # independent: the checkpoint
        embedding = f.get_tensor("model.embed_tokens.weight").nbytes
    assert embedding // 2 <= found["ranks"][0]["local_bytes"]
    assert json.loads(out)["out"] is not None
    status, out, _ = _run(["demo", "--format", "json", "--tp", "1", "--pp", "1"], capsys)
    assert status == 0 and json.loads(out)["out"] is None  # a temporary folder, removed
    assert out.lstrip().startswith("{")  # nothing but the JSON document on stdout


def test_schema_json_holds_the_installed_schema_and_its_path(capsys):
    status, out, _ = _run(["schema", "--format", "json"], capsys)
    found = json.loads(out)
    installed = ROOT / "schemas" / "architecture.schema.json"
    assert status == 0 and found["schema"] == json.loads(installed.read_text())
    assert Path(found["path"]).read_text() == installed.read_text()
    status, out, _ = _run(["schema", "--path", "--format", "json"], capsys)
    assert json.loads(out) == {"ok": True, "path": found["path"]}


def _sections(text: str) -> list[tuple[int, int, str]]:
    """(0-based line, level, heading) of the Markdown headings outside fenced code."""
    out, fenced = [], False
    for number, line in enumerate(text.split("\n")):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.append((number, len(line) - len(line.lstrip("#")), line))
    return out


def test_docs_prints_the_guide_and_a_section_of_it_and_json_says_the_same(capsys):
    guide = (ROOT / "docs" / "policy.md").read_text()
    status, out, _ = _run(["docs", "policy"], capsys)
    assert status == 0 and out == guide
    lines = guide.split("\n")
    headings = _sections(guide)
    (start, level, heading), *rest = [h for h in headings if "`require` and" in h[2]]
    stop = next((n for n, lv, _ in headings if n > start and lv <= level), len(lines))
    expected = "\n".join(lines[start:stop]).rstrip("\n") + "\n"
    status, out, _ = _run(["docs", "policy#require-and-replicate_unsupported"], capsys)
    assert status == 0 and out == expected and out.startswith(heading)
    status, out, _ = _run(["docs", "policy#require-and-replicate_unsupported", "--format",
                           "json"], capsys)
    found = json.loads(out)
    assert found["text"] == expected and found["line"] == start + 1
    assert Path(found["path"]).read_text() == guide
    status, out, _ = _run(["docs", "policy", "--path", "--format", "json"], capsys)
    assert json.loads(out) == {"ok": True, "topic": "policy", "path": found["path"],
                               "line": None}


def test_docs_without_a_topic_lists_the_guides_and_their_titles(capsys):
    on_disk = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    status, out, _ = _run(["docs"], capsys)
    assert status == 0
    listed = [line.split()[0] for line in out.split("\n\n")[0].splitlines()]
    assert [t for t in listed if "/" not in t] == on_disk
    first = (ROOT / "docs" / "authoring.md").read_text().split("\n")[0].lstrip("# ")
    assert f"authoring{' ' * 2}" in out and first in out
    status, out, _ = _run(["docs", "--format", "json"], capsys)
    guides = json.loads(out)["guides"]
    assert [g["topic"] for g in guides if "/" not in g["topic"]] == on_disk
    policy = next(g for g in guides if g["topic"] == "policy")
    text = (ROOT / "docs" / "policy.md").read_text().split("\n")
    assert [text[s["line"] - 1] for s in policy["sections"]] == [
        h for _, _, h in _sections("\n".join(text))]
    status, out, _ = _run(["docs", "--path"], capsys)
    assert status == 0 and Path(out.strip()) == Path(policy["path"]).parent
    status, out, _ = _run(["docs", "policy", "--list"], capsys)
    assert out.split()[0] == "policy" and all(w.startswith("policy#") for w in out.split()[1:])


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(("scale", "unit", "next_unit"), [
    (1, "B", "KiB"), (2**10, "KiB", "MiB"), (2**20, "MiB", "GiB"), (2**30, "GiB", "TiB")])
def test_sizes_at_the_unit_boundaries_are_whole_numbers_never_exponents(scale, unit, next_unit):
    assert byte_text(999 * scale) == f"999 {unit}"
    assert byte_text(1000 * scale) == f"1000 {unit}"
    assert byte_text(1023 * scale) == f"1023 {unit}"
    assert byte_text(1024 * scale) == f"1 {next_unit}"
    if unit != "B":
        assert byte_text(999.7 * scale) == f"1000 {unit}"
        assert byte_text(1023.7 * scale) == f"1 {next_unit}"  # rounds to 1024 of the unit
        assert byte_text(99.95 * scale) == f"100 {unit}"
        assert byte_text(1.5 * scale) == f"1.5 {unit}"


def test_terabytes_stay_in_tib_without_an_exponent():
    assert byte_text(1023 * 2**40) == "1023 TiB"
    assert byte_text(5000 * 2**40) == "5000 TiB"


# ------------------------------------------------------------------ unknown model_type


def test_an_unknown_model_type_points_to_partc_init_and_the_advice_works(tmp_path, capsys,
                                                                          monkeypatch):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(TINY, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"model_type": "foo-bar"}))
    status, out, _ = _run(["check", "--checkpoint", str(checkpoint), "--format", "json"],
                          capsys)
    (error,) = json.loads(out)["errors"]
    command = f"partc init --checkpoint {checkpoint} --out foo_bar.yaml"
    assert status == 1 and f"`{command}`" in error["message"]
    # the installed guide (the repository's under an editable install, the wheel's in CI)
    assert error["doc"].startswith("authoring#") and error["see"].startswith(
        str(docs_folder() / "authoring.md") + ":")
    status, _, err = _run(["check", "--config", str(checkpoint / "config.json")], capsys)
    assert status == 1 and f"`{command}`" in err and "see:" in err
    monkeypatch.chdir(tmp_path)  # follow the advice word for word
    assert main(command.split()[1:]) == 0
    capsys.readouterr()
    assert main(["check", "foo_bar.yaml", "--checkpoint", str(checkpoint)]) == 0
    (checkpoint / "model.safetensors").unlink()  # a config without a checkpoint beside it
    status, _, err = _run(["check", "--config", str(checkpoint / "config.json")], capsys)
    assert "`partc init --checkpoint CHECKPOINT --out foo_bar.yaml`" in err


# ------------------------------------------------------------------ demo's limits


def test_demo_help_states_its_limits_and_they_hold(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for claim in ("tiny Llama", "3 layers", "--tp 1, 2 or 4", "--pp up to 3", "no GPU",
                  "starts no processes", "no family, config or checkpoint of your own"):
        assert claim in text
    layers = json.loads((TINY / "config.json").read_text())["num_hidden_layers"]
    assert layers == 3
    assert main(["demo", "--tp", "4", "--pp", "3", "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ranks"]) == 12
    assert main(["demo", "--tp", "3", "--pp", "1"]) == 1
    assert main(["demo", "--tp", "1", "--pp", "4"]) == 1


# ------------------------------------------------------------------ serving install

BLOCKED = ("yaml", "jsonschema", "jinja2", "shtab")
SERVING = (
    "import sys\n"
    f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
    "import runpy\n"
    "sys.argv[0] = 'partc'\n"
    "runpy.run_module('partc', run_name='__main__')\n"
)


def _serving(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m partc ARGV` with the compiler's libraries unimportable, as in an install of
    numpy, ml_dtypes and the wheel with --no-deps."""
    return subprocess.run([sys.executable, "-c", SERVING, *argv], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def demo_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serving") / "build"
    assert main(["demo", "--out", str(out), "--format", "json"]) == 0
    return out


def test_inspect_runs_without_the_compilers_libraries(demo_build):
    text = _serving("inspect", str(demo_build))
    assert text.returncode == 0, text.stderr
    full = subprocess.run([sys.executable, "-m", "partc", "inspect", str(demo_build)],
                          capture_output=True, text=True, timeout=300)
    assert text.stdout == full.stdout and text.stdout.startswith(f"build {demo_build}")
    found = json.loads(_serving("inspect", str(demo_build), "--format", "json").stdout)
    assert found["kind"] == "build" and len(found["ranks"]) == 4
    rows = _serving("inspect", str(demo_build), "--rank", "0", "--format", "json")
    tensors = json.loads(rows.stdout)
    assert rows.returncode == 0 and len(tensors["tensors"]) == found["ranks"][0]["tensors"]
    assert tensors["origin_note"].startswith("not shown: finding them needs the compiler's")
    assert {t["origin"] for t in tensors["tensors"]} == {None}
    checkpoint = _serving("inspect", str(TINY), "--format", "json")
    inventory = json.loads(checkpoint.stdout)
    with safe_open(str(TINY / "model.safetensors"), "np") as f:
        assert inventory["tensors"] == len(list(f.keys()))


def test_a_compiling_command_without_the_libraries_says_what_to_install(demo_build):
    done = _serving("explain", str(demo_build), "model.norm.weight")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "needs the compiler's dependencies" in done.stderr
    done = _serving("completion", "bash")
    assert done.returncode == 1 and "lacks shtab" in done.stderr
