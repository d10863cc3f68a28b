"""Conversion of loaded numpy arrays: widened float dtypes and torch tensors sharing memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from partc.errors import LOAD_OPTIONS_DOC, CheckpointError, LaunchError
from partc.runtime.headers import ML_DTYPES


class _FloatDtypes:
    """The floating dtypes a `dtype=` conversion applies to: numpy's, and ml_dtypes' bf16 and
    fp8 (numpy kind 'V'), told by name so that asking never imports ml_dtypes."""

    __slots__ = ()

    def __contains__(self, dtype: object) -> bool:
        if not isinstance(dtype, np.dtype):
            return False
        return dtype.kind == "f" or (dtype.kind == "V" and dtype.name in _ML_FLOAT_NAMES)


_ML_FLOAT_NAMES = frozenset(name for name, _ in ML_DTYPES.values())
FLOAT_DTYPES = _FloatDtypes()
"""Floating dtypes a `dtype=` conversion applies to (bf16 and fp8 are numpy kind 'V')."""


_TORCH_VIEWS = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn",
                "float8_e5m2": "float8_e5m2", "float8_e8m0fnu": "float8_e8m0fnu"}
"""ml_dtypes dtype name -> torch dtype name, for types torch.from_numpy does not know."""


def float_dtype(dtype: Any) -> np.dtype[Any]:
    """`dtype` as a numpy floating dtype (ml_dtypes' bf16/fp8 included), or a LaunchError (the
    `dtype=` of `load()`)."""
    if isinstance(dtype, str) and dtype in {name for name, _ in ML_DTYPES.values()}:
        import ml_dtypes  # registers its names with numpy

        dtype = getattr(ml_dtypes, dtype, dtype)
    try:
        found: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise LaunchError(f"dtype must be a numpy floating dtype such as np.float32 or "
                          f"'bfloat16', found {dtype!r}", doc=LOAD_OPTIONS_DOC) from None
    if found.kind != "f" and found not in FLOAT_DTYPES:
        raise LaunchError(f"dtype must be a floating dtype, found {found}; integer and "
                          "packed tensors are never converted", doc=LOAD_OPTIONS_DOC)
    return found


def import_torch(feature: str) -> Any:
    """The torch module, or a CheckpointError naming `feature` and the `partc[torch]` extra."""
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise CheckpointError(f"{feature} needs torch, which is not installed; install partc's "
                              "torch extra: pip install 'partc[torch]'") from None
    return torch


def to_torch(tensors: dict[str, np.ndarray], bits: Mapping[str, str] | None = None
             ) -> dict[str, Any]:
    """Torch tensors sharing each array's memory (bf16/fp8 through an integer view).

    `bits` names the safetensors dtype of the tensors read as their bits (`BIT_DTYPES`: bf16
    as uint16, fp8 as uint8); each is viewed as torch's dtype of that name.
    """
    torch = import_torch("framework='torch'")
    out = {}
    for name, array in tensors.items():
        stored = None if bits is None else bits.get(name)
        special = (_TORCH_VIEWS.get(array.dtype.name) if stored is None
                   else _TORCH_VIEWS[ML_DTYPES[stored][0]])
        if special is None:
            out[name] = torch.from_numpy(array)
            continue
        torch_dtype = getattr(torch, special, None)
        if torch_dtype is None:
            raise CheckpointError(f"torch {torch.__version__} has no {special} for tensor "
                                  f"`{name}`", tensor=name)
        bits_view = array if stored is not None else array.view(
            np.uint16 if array.dtype.itemsize == 2 else np.uint8)
        out[name] = torch.from_numpy(bits_view).view(torch_dtype)
    return out
