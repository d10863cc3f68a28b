"""What the known Hugging Face config.json fields mean, checked before a family reads them.

A family declares only each field's type (`int`, `str`, ...); the meaning comes from here, as a
table of small checkers in the style of a JSON Schema validator's keyword functions:
`FIELD_MEANINGS` maps a field to a function returning what the value must be ('' when it is
fine), and `RELATIONS` check fields against each other (heads, experts). Only the fields a
family reads are checked (plus `ALWAYS_READ`, which every loader of the model reads), so a
config's unrelated extras never fail; a value of the wrong JSON type for a size is left to the
family's declared type, which reports it with the declaration.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from partc.errors import SemanticError
from partc.parallel.placements import TORCH_DTYPE_NAMES

if TYPE_CHECKING:
    from partc.front.load import RawDocument

MAX_CONFIG_DIMENSION = 2**31 - 1
"""Largest size a config field may give one axis (hidden size, vocabulary, experts, ...)."""

Checker = Callable[[Any], str]
"""Returns what a value must be, or '' when it is fine."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size(value: Any) -> str:
    """A count of heads, channels, layers or experts: at least 1."""
    if not _is_int(value) or 1 <= value <= MAX_CONFIG_DIMENSION:
        return ""
    return f"a positive integer of at most {MAX_CONFIG_DIMENSION}"


def _count(value: Any) -> str:
    """An optional count (shared experts, dense layers, a LoRA rank): at least 0 or null."""
    if not _is_int(value) or 0 <= value <= MAX_CONFIG_DIMENSION:
        return ""
    return f"an integer from 0 to {MAX_CONFIG_DIMENSION}"


def _dtype(value: Any) -> str:
    """A torch dtype name (null: not given)."""
    if value is None or (isinstance(value, str) and value in TORCH_DTYPE_NAMES):
        return ""
    return f"one of {', '.join(sorted(TORCH_DTYPE_NAMES))}"


def _object(value: Any) -> str:
    """A JSON object of settings (null: not given)."""
    return "" if value is None or isinstance(value, dict) else "a JSON object"


FIELD_MEANINGS: dict[str, Checker] = {
    **dict.fromkeys((
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "moe_intermediate_size",
        "n_routed_experts", "num_experts", "num_local_experts", "num_experts_per_tok",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_layer_freq",
        "decoder_sparse_step"), _size),
    **dict.fromkeys((
        "n_shared_experts", "first_k_dense_replace", "q_lora_rank",
        "shared_expert_intermediate_size", "num_nextn_predict_layers"), _count),
    "dtype": _dtype,
    "torch_dtype": _dtype,
    "quantization": _object,
    "quantization_config": _object,
}
"""The meaning of each known config field, by name."""

ALWAYS_READ = ("dtype", "torch_dtype", "quantization", "quantization_config")
"""Fields every binding reads: the default dtype of the weights, and the quantization
settings that transformers (`quantization_config`) and mlx-lm (`quantization`) read for any
model."""

EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
"""The spellings of a mixture-of-experts model's routed expert count."""


def _shown(value: Any) -> str:
    """A config value as a message quotes it: numbers plain, other values with their kind."""
    if _is_int(value):
        return str(value)
    kind = {str: "the string", list: "an array", dict: "an object", bool: "the boolean",
            float: "the number", type(None): ""}.get(type(value), type(value).__name__)
    text = json.dumps(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}".strip()


def read_fields(data: dict[str, Any], fields: Iterable[Sequence[str]]) -> set[str]:
    """The config fields a binding reads: for each family field (its dotted sources, the first
    present one wins) every source up to the one it reads, with each dotted prefix; plus
    `ALWAYS_READ`."""
    read = set(ALWAYS_READ)
    for sources in fields:
        for source in sources:
            parts = source.split(".")
            read.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            node: Any = data
            for part in parts:
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                break
    return read


def config_errors(config: RawDocument, read: Collection[str]) -> Iterator[SemanticError]:
    """Every known field among `read` whose value contradicts its meaning, then every broken
    relation between read fields; each located at the field in config.json."""
    data = config.data

    def fail(name: str, message: str) -> SemanticError:
        pointer = "/" + name.replace("~", "~0").replace("/", "~1")
        return SemanticError(message, location=config.locate(pointer), pointer=pointer)

    for name in sorted(read):
        check = FIELD_MEANINGS.get(name)
        if check is None or name not in data:
            continue
        expected = check(data[name])
        if expected:
            yield fail(name, f"config field `{name}` must be {expected}, found "
                             f"{_shown(data[name])}")
    for relation in RELATIONS:
        yield from relation(data, set(read), fail)


def _sizes(data: dict[str, Any], *names: str) -> list[int] | None:
    """The values of `names` when each is a valid size (None otherwise: reported elsewhere)."""
    values = [data.get(name) for name in names]
    if all(_is_int(v) and not _size(v) for v in values):
        return values  # type: ignore[return-value]
    return None


def _heads(data: dict[str, Any], read: set[str],
           fail: Callable[[str, str], SemanticError]) -> Iterator[SemanticError]:
    """Each KV head serves a whole group of query heads."""
    if not {"num_attention_heads", "num_key_value_heads"} & read:
        return
    found = _sizes(data, "num_attention_heads", "num_key_value_heads")
    if found is None:
        return
    heads, kv_heads = found
    if kv_heads > heads:
        yield fail("num_key_value_heads", f"`num_key_value_heads` ({kv_heads}) must be at most "
                   f"`num_attention_heads` ({heads}): each KV head serves one or more query heads")
    elif heads % kv_heads:
        yield fail("num_key_value_heads", f"`num_attention_heads` ({heads}) must be divisible by "
                   f"`num_key_value_heads` ({kv_heads}): each KV head serves the same number of "
                   "query heads")


def _experts(data: dict[str, Any], read: set[str],
             fail: Callable[[str, str], SemanticError]) -> Iterator[SemanticError]:
    """A token is routed to at most as many experts as there are."""
    for name in EXPERT_COUNTS:
        if name in read and name in data:
            found = _sizes(data, name, "num_experts_per_tok") if "num_experts_per_tok" in data \
                else None
            if found is not None and found[1] > found[0]:
                yield fail("num_experts_per_tok", f"`num_experts_per_tok` ({found[1]}) must be "
                           f"at most the number of experts, `{name}` ({found[0]})")
            return


RELATIONS: tuple[Callable[[dict[str, Any], set[str], Callable[[str, str], SemanticError]],
                          Iterator[SemanticError]], ...] = (_heads, _experts)
"""Checks between config fields, each applied when a family reads one of its fields."""
