"""The reference model of `partc verify`: a small random Hugging Face model of the architecture.

The config, shrunk when large (`partc.verify.shrink`), is built as a model with the
class transformers maps the config to (`AutoModelForCausalLM`, or `AutoModelForImageTextToText`
for a vision-language model) with `from_config`, given seeded noise on every weight and saved
with `save_pretrained`, so the checkpoint has exactly the on-disk names and layout that
transformers writes and reads back. The seeded inputs every check runs on are
`partc.verify.inputs.model_inputs`.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

from partc.errors import SourceLocation, VerifyError
from partc.front.load import MAX_CONFIG_BYTES, RawDocument, decode_text, parse_json, read_bytes

INSTALL_HINT = "pip install 'partc[verify]'"
"""How to get the libraries `partc verify` needs."""
NOISE = 0.1
"""Standard deviation of the seeded noise added to every weight (norms and biases included)."""
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText")
"""The transformers auto classes a reference model is built with, the first that maps the
config's class: text-only causal LMs, then vision-language models."""


def require_libraries() -> tuple[Any, Any]:
    """Import torch and transformers, or raise a VerifyError saying how to install them."""
    try:
        import torch
        import transformers
    except ImportError as missing:
        raise VerifyError(f"partc verify needs torch and transformers ({missing.name} is not "
                          f"installed): {INSTALL_HINT}") from None
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    return torch, transformers


# ---------------------------------------------------------------- building


def load_config(path: Path) -> RawDocument:
    """config.json read by partc's front end, as `partc check` reads it: a LoadError at the
    file (and line) when it is missing, not UTF-8, malformed or has a duplicate key."""
    raw = read_bytes(path, "config.json", MAX_CONFIG_BYTES)
    return parse_json(str(path), decode_text(raw, str(path), "config.json"), "config.json")


def model_class(transformers: Any, hf_config: Any) -> Any:
    """The first of AUTO_CLASSES that maps this transformers config to a model class."""
    for name in AUTO_CLASSES:
        auto = getattr(transformers, name)
        if type(hf_config) in auto._model_mapping:
            return auto
    return transformers.AutoModelForCausalLM  # its own error names the config class


_BUILD_ERRORS = (ValueError, KeyError, TypeError, AttributeError, RuntimeError, AssertionError)
"""What transformers (and torch, asserting on some arguments: a padding index) raise for a
config it cannot build a model of."""


def _refuses_config(error: Exception) -> bool:
    """Whether `error` is transformers refusing the config: one of _BUILD_ERRORS, or the
    validation error of huggingface_hub's strict config dataclasses (`StrictDataclassError`:
    `layer_types` of another length than `num_hidden_layers`), named rather than imported
    (only the command line imports huggingface_hub)."""
    return isinstance(error, _BUILD_ERRORS) or any(
        kind.__name__ == "StrictDataclassError" for kind in type(error).__mro__)


def new_model(config: dict[str, Any], source: SourceLocation | None = None, *,
              device: str | None = None) -> Any:
    """A model of `config` built by the class transformers maps it to (`model_class`),
    float32 and eager attention, on `device` ("meta": shapes only, no storage; None: torch's
    default); a VerifyError at `source` (the user's config) when transformers cannot build it."""
    torch, transformers = require_libraries()
    fields = dict(config)
    model_type = fields.pop("model_type")
    what = "causal LM"
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
        auto = model_class(transformers, hf_config)
        if auto is not transformers.AutoModelForCausalLM:
            what = "image-text-to-text model"
        with torch.device(device) if device else contextlib.nullcontext():
            return auto.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    except Exception as error:
        if not _refuses_config(error):
            raise
        raise VerifyError(f"transformers {transformers.__version__} cannot build a "
                          f"`{model_type}` {what} from the config: {error}",
                          location=source) from None


def build_reference(config: dict[str, Any], folder: Path, seed: int,
                    source: SourceLocation | None = None) -> None:
    """Write a seeded random model of `config` (config.json, model.safetensors) into `folder`;
    a VerifyError at `source` (the user's config) when transformers cannot build it."""
    torch, _ = require_libraries()
    torch.manual_seed(seed)
    model = new_model(config, source)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            parameter.add_(NOISE * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder, safe_serialization=True)


def load_model(folder: Path) -> Any:
    """A checkpoint folder loaded by transformers (its own on-disk to in-memory conversion)."""
    torch, transformers = require_libraries()
    auto = model_class(transformers, transformers.AutoConfig.from_pretrained(folder))
    model = auto.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.train(False)  # inference mode: dropout off
    return model


def parameter_sources(folder: Path, names: list[str]) -> dict[str, tuple[str, ...]]:
    """For every in-memory parameter, the on-disk tensors it is made of.

    Found by loading a copy of the checkpoint whose tensor i is filled with the constant i + 1:
    transformers' conversions (renames, stacking experts, fusing gate and up) move values
    without computing with them, so the constants a parameter holds name its sources.
    """
    torch, _ = require_libraries()
    from safetensors.torch import save_file

    tagged = folder.parent / f"{folder.name}-tagged"
    tagged.mkdir()
    (tagged / "config.json").write_bytes((folder / "config.json").read_bytes())
    shapes = tensor_shapes(folder)
    save_file({name: torch.full(shapes[name], float(i + 1)) for i, name in enumerate(names)},
              str(tagged / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(tagged)
    sources = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        values = torch.unique(parameter.detach()).tolist()
        sources[name] = tuple(names[int(v) - 1] for v in values
                              if v == math.floor(v) and 1 <= v <= len(names))
    return sources


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor of a single-file checkpoint folder."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
