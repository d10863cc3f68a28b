"""Helpers shared by the test modules: fixture paths, compile-then-import, byte comparisons."""

from __future__ import annotations

import importlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from partc.api import CompileOptions, compile_family
from partc.emit.render import package_name
from partc.parallel.specs import ShardingPolicy
from partc.plan.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
HF = FIXTURES / "hf"
QUANTIZED = FIXTURES / "quantized"
FULLSIZE = FIXTURES / "fullsize"


EXECUTOR_MODELS = [
    "llama", "llama_tied", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3",
    "qwen2_moe", "gemma2", "deepseek_v3", "deepseek_v2", "deepseek_v2_qlora", "gpt_oss", "granite",
    "stablelm", "stablelm_qk", "phi",
]
"""The fixtures whose model types the numpy reference executor (tests/executor) implements."""
LAYOUT_MODELS = ["gpt_neox", "falcon", "bloom", "gpt2", "olmo2", "codegen", "dbrx"]
"""Fixtures of the fused-layout, Conv1D and TP-reduced-norm families (docs/layouts.md; CodeGen's
grouped `[q | v | k]` qkv, DBRX's clamped Wqkv and fused per-expert tensors): `partc verify`
checks them against transformers, and the executor's table-described families
(tests/executor/variants.py) run them from partc's loaded shards in tests/test_numerics.py."""
HF_MODELS = [*EXECUTOR_MODELS, *LAYOUT_MODELS]
"""Every tiny HF fixture with reference outputs, one or more per built-in family."""
FALLS_BACK_OVER_FOUR = {"olmo2", "deepseek_v3_fp8", "llama_mlx4", "gpt_oss_mxfp4"}
"""Fixtures illegal over 4 ranks under Require: OLMo-2's 2 KV heads (no KV replication: its
k_norm statistic spans every KV head), DeepSeek's FP8 blocks of 16 rows, MLX's groups of 32
columns (o_proj by single heads of 16) and gpt-oss's 3 MXFP4 expert block units. The others
are legal: 4 (MLA or multi-head) heads, or 2 KV heads repeated by KV replication."""


def hf(name: str) -> Path:
    """Folder of one tiny HF fixture."""
    return HF / name


def edited_family(folder: Path, name: str, old: str, new: str) -> Path:
    """The built-in family `name` with its one occurrence of `old` replaced by `new`, written
    to `folder` under the built-in's file name."""
    text = (ROOT / "architectures" / f"{name}.yaml").read_text()
    assert text.count(old) == 1, old
    path = folder / f"{name}.yaml"
    path.write_text(text.replace(old, new))
    return path


def fp8_scales_family(folder: Path, *, down_scale_axis: int, gate_segments: bool) -> Path:
    """Qwen3 with its MLP's FP8 weights and `weight_scale_inv` companions declared as members
    (so the family, not the linear format, says how each scale is split)."""
    text = (ROOT / "architectures" / "qwen3.yaml").read_text()
    start = text.index('  - name: "layers.{unit}.mlp"')
    end = text.index("  - name: final_norm")

    def member(proj: str, shape: str, sharding: str, scale_axis: int) -> str:
        scales = shape.replace("intermediate_size", "intermediate_size // 16").replace(
            "hidden_size]", "hidden_size // 16]").replace("[hidden_size,", "[hidden_size // 16,")
        return (f'      - {{target: "model.layers.{{unit}}.mlp.{proj}.weight", shape: {shape}, '
                f"sharding: {sharding}, dtype: F8_E4M3}}\n"
                f'      - {{target: "model.layers.{{unit}}.mlp.{proj}.weight_scale_inv", '
                f"shape: {scales}, sharding: {{partitioned: {scale_axis}}}, dtype: F32}}\n")

    gate = ('{partitioned_segments: {axis: 0, segments: "[intermediate_size // 2] * 2"}}'
            if gate_segments else "{partitioned: 0}")
    group = ('  - name: "layers.{unit}.mlp"\n    role: feed_forward_intermediate\n'
             "    owner: {unit: decoder}\n    units: intermediate_size // 32\n    members:\n"
             + member("gate_proj", "[intermediate_size, hidden_size]", gate, 0)
             + member("up_proj", "[intermediate_size, hidden_size]", "{partitioned: 0}", 0)
             + member("down_proj", "[hidden_size, intermediate_size]", "{partitioned: 1}",
                      down_scale_axis) + "\n")
    path = folder / "qwen3.yaml"
    path.write_text(text[:start] + group + text[end:])
    return path


def check_case(folder: Path) -> list[Any]:
    """The errors `partc check` gives for a case folder's family.yaml and config.json, checked
    from inside the folder (so their locations read `family.yaml:line`)."""
    import os

    from partc.api import check_family

    previous = os.getcwd()
    os.chdir(folder)
    try:
        return list(check_family("family.yaml", "config.json"))
    finally:
        os.chdir(previous)


class ColumnQuarter:
    """The second quarter of the columns of a checkpoint's `model.layers.0.mlp.down_proj.weight`
    read with a `CheckpointReader`: what came back, what was read, the runs that hold it."""

    NAME = "model.layers.0.mlp.down_proj.weight"

    def __init__(self, path: Path, **options: Any) -> None:
        from partc.runtime._engine.reader import CheckpointReader
        from partc.runtime._engine.selection import ReadOptions, TensorSelection
        from partc.runtime.checkpoint import open_checkpoint
        from partc.runtime.headers import DTYPES

        checkpoint = open_checkpoint(path)
        header, self.entry = checkpoint.tensor(self.NAME)
        self.path = header.path
        self.rows, self.cols = self.entry.shape
        self.item = DTYPES[self.entry.dtype].itemsize
        self.base = header.data_start + self.entry.begin
        self.selection = TensorSelection(axis=1, ranges=((self.cols // 4, self.cols // 2),))
        self.recorder = Recorder()
        with CheckpointReader(checkpoint, ReadOptions(recorder=self.recorder, **options)) as r:
            self.got = r.read_many([(self.NAME, self.selection)])[self.NAME]

    def runs(self) -> list[tuple[int, int]]:
        """(offset, length) of each row's selected columns in the file."""
        width = (self.cols // 2 - self.cols // 4) * self.item
        return [(self.base + (row * self.cols + self.cols // 4) * self.item, width)
                for row in range(self.rows)]

    def assert_equal_to_safetensors(self) -> None:
        """The bytes read are safetensors' own slice of the tensor."""
        np.testing.assert_array_equal(
            self.got.view(np.uint8),
            load_file(str(self.path))[self.NAME][:, self.cols // 4:self.cols // 2].view(np.uint8))


def direct_supported(path: Path) -> bool:
    """Whether the file system holding `path` opens files with O_DIRECT."""
    import os

    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def fixture_folder(name: str) -> Path:
    """Folder of one tiny fixture: `hf/<name>`, else `quantized/<name>`."""
    return hf(name) if (HF / name).is_dir() else QUANTIZED / name


def policy_for(name: str, tp: int) -> ShardingPolicy:
    """The sharding policy a fixture needs at T: Require, except for FALLS_BACK_OVER_FOUR.

    Every fixture shards legally over 2 ranks, and over 4 all but FALLS_BACK_OVER_FOUR (KV
    replication repeats 2 KV heads over 4 ranks in every built-in GQA family but OLMo-2).
    """
    if tp > 2 and name in FALLS_BACK_OVER_FOUR:
        return ShardingPolicy.REPLICATE_UNSUPPORTED
    return ShardingPolicy.REQUIRE


class Recorder:
    """Collects every (path, offset, length) run a checkpoint reader reports."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int, int]] = []

    def record(self, path: str, offset: int, length: int) -> None:
        """Record one read run."""
        self.runs.append((path, offset, length))


def bits(array: np.ndarray) -> np.ndarray:
    """The bytes of an array, flat (so that NaN payloads and -0.0 compare exactly)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Assert two tensor maps hold the same names in order, dtypes, shapes and bytes."""
    assert list(got) == list(want)
    for name, array in got.items():
        assert array.dtype == want[name].dtype and array.shape == want[name].shape, name
        np.testing.assert_array_equal(bits(array), bits(want[name]), err_msg=name)


def checkpoint_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a single-file fixture checkpoint, read with safetensors itself."""
    return load_file(str(folder / "model.safetensors"))


def import_build(out: Path, plan: Any = None) -> Any:
    """Import the generated package of a build folder (fresh, even if imported before); the
    package is found in the folder when no plan is given."""
    name = package_name(plan) if plan is not None else next(
        p.name for p in sorted(out.iterdir()) if p.is_dir() and p.name.startswith("partc_"))
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(out))


def compile_and_import(family: str | Path | None, config: Path, out: Path, *, tp: int = 1,
                       pp: int = 1, **options: Any) -> tuple[Any, Any]:
    """Compile into `out` and import the generated package; returns (plan, package)."""
    sizes = {k: options.pop(k) for k in ("expert_parallel_size", "expert_tensor_parallel_size")
             if k in options}
    result = compile_family(family, config,
                            Topology(tensor_parallel_size=tp, pipeline_parallel_size=pp, **sizes),
                            CompileOptions(out=out, **options))
    return result.plan, import_build(out, result.plan)


def reassemble(pieces: list[tuple[np.ndarray, int | None, tuple[tuple[int, int], ...]]],
               shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Scatter rank-local arrays back into a global array; returns (array, ownership counts)."""
    out = np.zeros(shape, dtype=dtype)
    count = np.zeros(shape, dtype=np.int64)
    for local, axis, ranges in pieces:
        if axis is None:
            out[...] = local
            count += 1
            continue
        offset = 0
        for start, end in ranges:
            width = end - start
            index = [slice(None)] * len(shape)
            index[axis] = slice(start, end)
            source = [slice(None)] * len(shape)
            source[axis] = slice(offset, offset + width)
            out[tuple(index)] = local[tuple(source)]
            count[tuple(index)] += 1
            offset += width
    return out, count


def compile_and_load(family: str | Path | None, config: Path, out: Path, weights: Path, *,
                     tp: int, pp: int = 1, **options: Any) -> tuple[Any, list[Any]]:
    """Compile, import the generated package, load every rank, then forget the package.

    Forgetting it keeps a later `import partc_<family>_tp<T>_pp<S>` (another test's build of
    the same name) from finding this one in `sys.modules`.
    """
    plan, package = compile_and_import(family, config, out, tp=tp, pp=pp, **options)
    try:
        states = [package.load(weights, rank=r) for r in range(tp * pp)]
    finally:
        name = package_name(plan)
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
    return plan, states


def write_sparse_safetensors(path: Path, header: dict[str, Any]) -> Path:
    """Write `header` as a real safetensors file whose data region is never written (sparse):
    full-size inventories checked and compiled without their weights."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + end)
    return path


def fullsize_checkpoint(model: str, folder: Path) -> Path:
    """The full-size header of `tests/fixtures/fullsize/<model>` as a sparse safetensors file."""
    header = json.loads((FULLSIZE / model / "safetensors_header.json").read_text())
    return write_sparse_safetensors(folder / f"{model}.safetensors", header)



def file_mappings(path: Path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of every mapping of `path` in this process (/proc/self/maps)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path.resolve()):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[1]))
    return found


LLAMA_70B = {k: v for k, v in json.loads((FULLSIZE / "Llama-3.1-70B" / "config.json")
                                         .read_text()).items()
             if k in ("hidden_size", "intermediate_size", "num_attention_heads",
                      "num_key_value_heads", "num_hidden_layers", "vocab_size")}
"""Llama-3.1-70B's sizes, written over a vision-language fixture's text_config."""
VIT_L = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
         "num_attention_heads": 16, "image_size": 336, "patch_size": 14}
"""A ViT-L/14-336 vision tower's sizes (LLaVA-1.5's CLIP tower)."""


def edited_config(name: str, top: dict[str, Any],
                  sections: dict[str, dict[str, Any]] | None = None,
                  drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """A tiny fixture's config with sizes written over it (and section keys dropped)."""
    config = json.loads((hf(name) / "config.json").read_text())
    config.update(top)
    for section, fields in (sections or {}).items():
        config[section] = {k: v for k, v in {**config[section], **fields}.items()
                           if k not in drop}
    return dict(config)


def large_vision_language(name: str) -> dict[str, Any]:
    """The llava or qwen2_vl fixture with Llama-3.1-70B's decoder and a ViT-L-sized tower
    (Qwen2-VL's spelled `embed_dim`, `depth`, `num_heads`, its merger out 8192 wide)."""
    if name == "llava":
        return edited_config("llava", {"image_token_index": 128000, "image_seq_length": 576},
                             {"text_config": LLAMA_70B, "vision_config": VIT_L},
                             drop=("head_dim",))
    return edited_config("qwen2_vl", {}, {
        "text_config": {**LLAMA_70B, "layer_types": ["full_attention"] * 80,
                        "rope_parameters": {"mrope_section": [16, 24, 24], "rope_theta": 1e6,
                                            "rope_type": "default"}},
        "vision_config": {"hidden_size": LLAMA_70B["hidden_size"], "embed_dim": 1024,
                          "depth": 24, "num_heads": 16}})
