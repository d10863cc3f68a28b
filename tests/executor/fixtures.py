"""Reading the checkpoints under ``tests/fixtures`` with numpy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _numpy_shim() -> None:
    """Let safetensors' numpy backend find the 8-bit float dtypes (it looks them up on numpy)."""
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if not hasattr(np, name):
            setattr(np, name, getattr(ml_dtypes, name))


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Read every tensor of one safetensors file, keeping the stored dtypes."""
    _numpy_shim()
    return dict(load_file(str(path)))


def fixture_folder(name: str) -> Path:
    """The folder of fixture ``name``: ``hf/`` first, then ``hf_pending/``, then ``quantized/``.

    Fixtures of newly added families start in ``hf_pending/`` and move to ``hf/`` later; both
    are accepted and ``hf/`` wins when both exist.
    """
    for parent in ("hf", "hf_pending", "quantized"):
        folder = FIXTURES / parent / name
        if folder.is_dir():
            return folder
    raise FileNotFoundError(f"no fixture {name!r} under {FIXTURES}/(hf|hf_pending|quantized)")


def load_fixture(
    name: str,
) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Return ``(config, tensors, reference)`` of ``hf/<name>``, ``hf_pending/<name>`` or
    ``quantized/<name>`` (the first folder that exists, in that order)."""
    folder = fixture_folder(name)
    quantized = folder.parent.name == "quantized"
    reference_file = "reference_dequant.npz" if quantized else "reference.npz"
    config = json.loads((folder / "config.json").read_text())
    tensors = load_safetensors(folder / "model.safetensors")
    with np.load(folder / reference_file) as npz:
        reference = {key: npz[key] for key in npz.files}
    return config, tensors, reference
