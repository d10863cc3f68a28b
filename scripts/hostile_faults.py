"""The faults of issue 39's surfaces for scripts/fault_table.py: a tampered plan.json through
`inspect`, an expert placement file through `compile --ep`, hostile checkpoint names through
`partc init`, over-long paths and `extends:` bases; and the limits those surfaces enforce."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"
QWEN = ROOT / "tests" / "fixtures" / "hf" / "qwen3_moe"
Setup = Callable[[Path], list[str]]
"""Builds a fault's inputs in a scratch folder; returns the `partc` arguments."""


def _tampered(edit: Callable[[dict[str, Any]], object] | None = None,
              text: Callable[[str], str] | None = None) -> Setup:
    """A tiny Llama TP 2 x PP 2 build whose plan.json is edited (as data or as text), shown
    by `inspect`."""
    def setup(scratch: Path) -> list[str]:
        from partc.api import CompileOptions, compile_family
        from partc.plan.topology import Topology

        build = scratch / "tampered"
        compile_family("llama", LLAMA / "config.json",
                       Topology(tensor_parallel_size=2, pipeline_parallel_size=2),
                       CompileOptions(out=build))
        plan = build / "plan.json"
        if edit is not None:
            document = json.loads(plan.read_text())
            edit(document)
            plan.write_text(json.dumps(document, indent=1))
        if text is not None:
            plan.write_text(text(plan.read_text()))
        return ["inspect", "tampered"]
    return setup


def _at(*path: Any) -> Callable[[dict[str, Any]], None]:
    """An edit setting the plan's value at `path[:-1]` to `path[-1]`."""
    def edit(document: dict[str, Any]) -> None:
        node: Any = document
        for key in path[:-2]:
            node = node[key]
        node[path[-2]] = path[-1]
    return edit


def _placement(text: str) -> Setup:
    """`compile` of the tiny Qwen3-MoE (8 experts) over EP 2 with placement file `text`."""
    def setup(scratch: Path) -> list[str]:
        shutil.copy(QWEN / "config.json", scratch / "qwen.json")
        (scratch / "placement.json").write_text(text)
        return ["compile", "--config", "qwen.json", "--ep", "2", "--expert-placement",
                "placement.json", "--out", "build"]
    return setup


def _init(names: list[str], rename: tuple[str, str] | None = None) -> Setup:
    """`partc init` of the tiny Llama checkpoint with tensors `names` added (each a 1-element
    float32), or its names' `rename[0]` replaced by `rename[1]`."""
    def setup(scratch: Path) -> list[str]:
        from safetensors.numpy import load_file, save_file

        folder = scratch / "ck"
        folder.mkdir()
        shutil.copy(LLAMA / "config.json", folder / "config.json")
        tensors = load_file(LLAMA / "model.safetensors")
        if rename is not None:
            tensors = {name.replace(*rename): array for name, array in tensors.items()}
        tensors.update({name: np.zeros(1, np.float32) for name in names})
        save_file(tensors, folder / "model.safetensors")
        return ["init", "--checkpoint", "ck", "--out", "family.yaml"]
    return setup


def _family(text: str, name: str = "family.yaml", **others: str) -> Setup:
    """`check` of a family file `name` holding `text` (and the files `others`, by name with
    `_` for `.`)."""
    def setup(scratch: Path) -> list[str]:
        for other, content in others.items():
            (scratch / other.replace("_", ".")).write_text(content)
        if len(name.encode()) <= 255:
            (scratch / name).write_text(text)
        return ["check", name]
    return setup


def hostile_faults() -> Iterator[tuple[str, str, str, Setup]]:
    """(area, name, what is wrong, setup) of every fault of issue 39's surfaces."""
    plans: list[tuple[str, str, Setup]] = [
        ("pipeline_of_a_billion_stages", "S = 10^9 in an 11 KB plan (sent inspect to 7.8 GB)",
         _tampered(_at("topology", "pipeline_parallel_size", 10 ** 9))),
        ("integer_of_5000_digits", "a 5000-digit T",
         _tampered(text=lambda t: t.replace('"tensor_parallel_size":2',
                                            '"tensor_parallel_size":' + "9" * 5000))),
        ("negative_dimension", "a tensor dimension of -5",
         _tampered(_at("tensors", 0, "shape", 0, -5))),
        ("nan_dimension", "a tensor dimension of NaN",
         _tampered(_at("tensors", 0, "shape", 0, float("nan")))),
        ("range_past_the_shape", "a placement range past its axis",
         _tampered(_at("tensors", 0, "placements", 1, ["range", 0, 66, 999]))),
        ("stage_99", "a tensor on stage 99 of 2", _tampered(_at("tensors", 0, "stages", [99]))),
        ("unknown_dtype", "a dtype no checkpoint has",
         _tampered(_at("tensors", 0, "dtype", "F99"))),
        ("unlisted_group", "a tensor of a group the plan does not list",
         _tampered(_at("tensors", 0, "group", "nowhere"))),
        ("unknown_key", "a key the plan schema does not have",
         _tampered(_at("payload", "anything"))),
    ]
    for name, what, setup in plans:
        yield "plan", name, what, setup
    placements: list[tuple[str, str, Setup]] = [
        ("900000_ids", "900,000 ids of -1 (took 25 s and 1 GB)",
         _placement(json.dumps({"ranks": [[-1] * 450_000, [-1] * 450_000]}))),
        ("ids_out_of_range", "ids below 0 and past the 8 experts",
         _placement(json.dumps({"ranks": [[-1, -2, 0, 1], [8, 9, 2, 3]]}))),
        ("rank_count", "3 EP ranks for --ep 2",
         _placement(json.dumps({"ranks": [[0, 1, 2], [3, 4, 5], [6, 7]]}))),
        ("not_an_object", "a list instead of {\"ranks\": ...}", _placement("[[0, 1], [2, 3]]")),
        ("id_of_5000_digits", "a 5000-digit id",
         _placement('{"ranks": [[0, 1, 2, 3], [4, 5, 6, ' + "9" * 5000 + "]]}")),
    ]
    for name, what, setup in placements:
        yield "placement", name, what, setup
    inits: list[tuple[str, str, Setup]] = [
        ("name_over_the_template_limit", "a 947-character tensor name",
         _init(["a" * 900 + "{}" * 20 + ".weight"])),
        ("layer_number_with_a_leading_zero", "layer `01`", _init([], ("layers.1.", "layers.01."))),
        ("parameter_name_not_an_identifier", "tensor `m.a-b`", _init(["m.a-b"])),
        ("2000_loose_tensors", "2000 tensors outside the layers",
         _init([f"loose{n}" for n in range(2000)])),
    ]
    for name, what, setup in inits:
        yield "init", name, what, setup
    long = "a" * 300 + ".yaml"
    paths: list[tuple[str, str, Setup]] = [
        ("family_name_of_300_bytes", "a family file name of 305 bytes", _family("", long)),
        ("extends_name_of_300_bytes", "`extends:` a name of 305 bytes",
         _family(f"extends: {long}\n")),
        ("extends_a_scalar", "`extends:` a base file that is a number",
         _family("extends: base.yaml\n", base_yaml="7\n")),
        ("extends_a_list", "`extends:` a base file that is a list",
         _family("extends: base.yaml\n", base_yaml="[1, 2]\n")),
    ]
    for name, what, setup in paths:
        yield "family_file", name, what, setup


def hostile_limits() -> list[tuple[str, str, str]]:
    """(input, at most, constant) of every bound issue 39's surfaces enforce."""
    from partc.front import load
    from partc.plan import expert_placement, plan_checks
    from partc.runtime import rank_env
    from partc.scaffold import survey

    return [
        ("plan.json size", f"{load.MAX_PLAN_BYTES} bytes", "partc.front.load.MAX_PLAN_BYTES"),
        ("T, S, E, X and `kv_replicas` in a plan.json", str(plan_checks.MAX_PARALLEL_SIZE),
         "partc.plan.plan_checks.MAX_PARALLEL_SIZE"),
        ("a tensor dimension in a plan.json", f"2**{plan_checks.MAX_DIMENSION.bit_length() - 1}",
         "partc.plan.plan_checks.MAX_DIMENSION"),
        ("elements of a tensor in a plan.json", f"2**{plan_checks.MAX_ELEMENTS.bit_length() - 1}",
         "partc.plan.plan_checks.MAX_ELEMENTS"),
        ("expert placement file size", f"{expert_placement.PLACEMENT_BASE_BYTES} bytes + "
         f"{expert_placement.PLACEMENT_BYTES_PER_SLOT} per slot (experts x E)",
         "partc.plan.expert_placement.placement_byte_limit"),
        ("expert placement errors reported", str(expert_placement.MAX_PLACEMENT_ERRORS),
         "partc.plan.expert_placement.MAX_PLACEMENT_ERRORS"),
        ("digits of a launcher variable (RANK, WORLD_SIZE, ...)", str(rank_env.MAX_DIGITS),
         "partc.runtime.rank_env.MAX_DIGITS"),
        ("tensors outside the layers `partc init` writes", str(survey.MAX_OUTSIDE),
         "partc.scaffold.survey.MAX_OUTSIDE"),
        ("a tensor name `partc init` writes (braces doubled)", f"{survey.MAX_NAME} characters",
         "partc.scaffold.survey.MAX_NAME"),
        ("a file name, a path", "255 bytes, 4096 bytes (the operating system's)",
         "partc.front.load.long_path_error"),
    ]
