"""`partc init` of a quantized checkpoint: its stored tensors read back as the dense weights a
family declares, and the `linear_formats:` entry that stores them again.

A family declares its linear weights dense (`weight [out, in]`) and names the checkpoint's
encoding once, in `linear_formats:` (docs/linear_formats.md); binding derives every packed weight
and companion from it, sharded with its weight. So the scaffold of a quantized checkpoint is the
scaffold of its dense twin plus that entry: `dense_header` recognises the format from the
config's quantization block (transformers' `quantization_config.quant_method` `fp8` or `mxfp4`,
mlx-lm's `quantization`), folds each encoded weight's stored tensors back into the dense tensor
(name, logical shape, the dense dtype), and returns a `Quantized` that declares the config
fields the entry reads and the entry itself, applying to the weights the checkpoint encodes.

- `block_fp8`: `X.weight` F8_E4M3 `[..., out, in]` + `X.weight_scale_inv`
  `[..., ceil(out/B0), ceil(in/B1)]` -> `X.weight [..., out, in]`.
- `mlx_affine`: `X.weight` U32 `[..., out, in*bits/32]` + `X.scales`, `X.biases`
  `[..., out, in/group]` -> `X.weight [..., out, in]` in the scales' dtype.
- `mxfp4`: `X_blocks` U8 `[..., out, in/32, 16]` + `X_scales` U8 `[..., out, in/32]` -> `X`
  `[..., in, out]`: transformers' gpt-oss (the format's one model) holds its experts
  transposed (`format: linear_transposed`), and `mxfp4` stores output-major whatever that layout.

A stored tensor whose companions are missing or sized otherwise is left as the header has it
(the scaffold then marks its shape CHECK as for any unexplained tensor).
"""

from __future__ import annotations

import glob
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partc.parallel.formats import (
    MLX_BITS,
    MLX_GROUP_SIZES,
    MXFP4_BLOCK_BYTES,
    MXFP4_BLOCK_ELEMENTS,
    target_matches,
)
from partc.scaffold.yaml_writer import Flow, FlowList, Quoted

Signature = tuple[str, list[int]]
"""A tensor's (dtype, shape) in the header."""


@dataclass(frozen=True, slots=True)
class Quantized:
    """A checkpoint's linear format as the scaffold declares it."""

    fields: Mapping[str, Flow]
    """The config fields the entry reads, by name."""
    entry: Mapping[str, Any]
    """The `linear_formats:` entry."""
    encoded: int
    """How many dense weights the checkpoint stores encoded."""

    def declare(self, fields: dict[str, Any], document: dict[str, Any]) -> None:
        """Add the config fields (those the scaffold does not declare already) and the
        `linear_formats:` section to the family document."""
        for key, value in self.fields.items():
            fields.setdefault(key, value)
        document["linear_formats"] = [dict(self.entry)]


def dense_header(header: Mapping[str, Signature], config: Mapping[str, Any], dense: str
                 ) -> tuple[dict[str, Signature], Quantized | None]:
    """The header with every weight the config's quantization encodes folded back into its
    dense tensor (dtype `dense` unless the format keeps it in its scales'), and the format; the
    header unchanged and None when the config names no format partc stores."""
    block = config.get("quantization_config")
    method = block.get("quant_method") if isinstance(block, Mapping) else None
    mlx = config.get("quantization")
    if method == "fp8" and isinstance(block, Mapping):
        size = block.get("weight_block_size")
        if isinstance(size, list) and len(size) == 2 and all(_positive(b) for b in size):
            return _fp8(header, dense, (size[0], size[1]))
    elif method == "mxfp4":
        return _mxfp4(header, dense)
    elif isinstance(mlx, Mapping) and mlx.get("bits") in MLX_BITS and mlx.get(
            "group_size") in MLX_GROUP_SIZES and _positive(mlx["bits"]) and _positive(
            mlx["group_size"]):
        return _mlx(header, int(mlx["bits"]), int(mlx["group_size"]))
    return dict(header), None


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_QUANT_METHOD = Flow(type="str", **{"from": "quantization_config.quant_method"},
                     default="none")


def _fp8(header: Mapping[str, Signature], dense: str, block: tuple[int, int]
         ) -> tuple[dict[str, Signature], Quantized | None]:
    out: dict[str, Signature] = dict(header)
    encoded: list[str] = []
    scale_dtypes: set[str] = set()
    for name, (dtype, shape) in header.items():
        scale = header.get(name + "_scale_inv")
        if not name.endswith(".weight") or dtype != "F8_E4M3" or len(shape) < 2 or scale is None:
            continue
        grid = [*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
        if scale[1] != grid:
            continue
        out[name] = (dense, list(shape))
        del out[name + "_scale_inv"]
        encoded.append(name)
        scale_dtypes.add(scale[0])
    if not encoded or len(scale_dtypes) != 1:
        return dict(header), None
    fields = {"quant_method": _QUANT_METHOD,
              "weight_block_size": Flow(type="int_list",
                                        **{"from": "quantization_config.weight_block_size"},
                                        default=FlowList([128, 128]))}
    stored = scale_dtypes.pop()
    if stored == dense:  # Qwen's: the scales in the model's dtype, whatever a config makes it
        fields["dtype"] = Flow(type="str", **{"from": FlowList(["dtype", "torch_dtype"])},
                               default="float32")
    entry = {"format": "block_fp8", "when": Quoted("quant_method == 'fp8'"),
             "block": "weight_block_size", "scale_dtype": "dtype" if stored == dense else stored,
             "applies_to": _patterns(out, encoded, lambda shape: True)}
    return out, Quantized(fields, entry, len(encoded))


def _mlx(header: Mapping[str, Signature], bits: int, group: int
         ) -> tuple[dict[str, Signature], Quantized | None]:
    out: dict[str, Signature] = dict(header)
    encoded: list[str] = []
    for name, (dtype, shape) in header.items():
        module = name.removesuffix(".weight")
        scales, biases = header.get(module + ".scales"), header.get(module + ".biases")
        if (module == name or dtype != "U32" or len(shape) < 2 or scales is None
                or biases is None or scales[1] != biases[1] or scales[1][:-1] != shape[:-1]
                or shape[-1] * 32 != scales[1][-1] * group * bits):
            continue
        out[name] = (scales[0], [*shape[:-1], scales[1][-1] * group])
        del out[module + ".scales"], out[module + ".biases"]
        encoded.append(name)
    if not encoded:
        return dict(header), None
    fields = {"mlx_bits": Flow(type="int", **{"from": "quantization.bits"}, default=0),
              "mlx_group_size": Flow(type="int", **{"from": "quantization.group_size"},
                                     default=64)}
    entry = {"format": "mlx_affine", "when": Quoted("mlx_bits > 0"), "bits": "mlx_bits",
             "group_size": "mlx_group_size",  # mlx-lm leaves a width off the groups dense
             "applies_to": _patterns(out, encoded, lambda shape: shape[-1] % group == 0)}
    return out, Quantized(fields, entry, len(encoded))


def _mxfp4(header: Mapping[str, Signature], dense: str
           ) -> tuple[dict[str, Signature], Quantized | None]:
    out: dict[str, Signature] = dict(header)
    encoded: list[str] = []
    for name, (dtype, shape) in header.items():
        weight = name.removesuffix("_blocks")
        scales = header.get(weight + "_scales")
        if (weight == name or weight in header or dtype != "U8" or len(shape) < 3
                or shape[-1] != MXFP4_BLOCK_BYTES or scales is None or scales[0] != "U8"
                or scales[1] != shape[:-1]):
            continue
        out[weight] = (dense, [*shape[:-3], shape[-2] * MXFP4_BLOCK_ELEMENTS, shape[-3]])
        del out[name], out[weight + "_scales"]
        encoded.append(weight)
    if not encoded:
        return dict(header), None
    entry = {"format": "mxfp4", "when": Quoted("quant_method == 'mxfp4'"),
             "applies_to": _patterns(out, encoded,
                                     lambda shape: shape[-2] % MXFP4_BLOCK_ELEMENTS == 0)}
    return out, Quantized({"quant_method": _QUANT_METHOD}, entry, len(encoded))


_NUMBER = re.compile(r"(?<=\.)(?:0|[1-9][0-9]*)(?=\.|$)")
"""A repetition's number inside a dotted name (a layer's, an expert's)."""


def _patterns(dense: Mapping[str, Signature], encoded: list[str],
              eligible: Any) -> FlowList:
    """The `applies_to` globs of the `encoded` weights, each as short as leaves every other
    weight the format could encode (two axes or more, `eligible` by shape) dense: `*` when
    it encodes them all, else `*.<module>` by the module's last name, else its whole name with
    repetition numbers as `*`, else the name itself."""
    names = set(encoded)
    others = [_real(n) for n, (_, shape) in dense.items()
              if n not in names and len(shape) >= 2 and eligible(shape)]
    if not others:
        return FlowList([Quoted("*")])
    found: set[str] = set()
    for name in encoded:
        real = _real(name)
        module = real.removesuffix(".weight")
        leaf = glob.escape(module.rpartition(".")[2])
        for pattern in (f"*.{leaf}", _NUMBER.sub("*", glob.escape(module))):
            if not any(target_matches(pattern, other) for other in others):
                found.add(pattern)
                break
        else:
            found.add(glob.escape(real))
    return FlowList(Quoted(p) for p in sorted(found))


def _real(name: str) -> str:
    """A header name as the checkpoint spells it (the scaffold's literal doubles braces)."""
    return name.replace("{{", "{").replace("}}", "}")

