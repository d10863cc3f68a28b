"""The structural cache of `bind`: build each distinct group structure once, rename the rest.

A family declares a parameter group once and `bind` instantiates it per unit, per loop value
(every layer, every expert): DeepSeek-V3 expands 61 declarations to 15,480 groups. Nearly all
instances of one declaration build groups that differ only by their names, and validating a
`ParameterGroupSpec` (shapes, shardings, segments, heads, dtypes, linear layouts) costs far
more than evaluating its names. The cache builds and validates one instance per structure in
full, and makes the others as renamed copies of it.

**The key** (`StructureKey`) of an instance is everything the full build reads besides the
names it writes:

- `declaration`: the pointer of the group declaration (unique within one family document,
  and a cache lives for one bind of one family);
- `values`: a number for the instance's evaluated values, everything `_build_group` evaluates
  besides the module paths and member targets (units, member shapes, segment widths, dtypes,
  head counts, which `when` conditions hold and which parameters exist), equal numbers for
  equal values of one declaration;
- `fused_prefix`: for a fused group, which member targets start with the output module's path
  (the output module's weights are the ones `linear: false` strips);
- `format_facts`: all that expanding under the linear format reads of the member targets
  (which `applies_to`/`except` patterns each matches, whether each is a `.weight`), from
  `bind.linear_formats.target_facts`.

**Why a renamed copy is sound.** Every rule a group or member checks in `__post_init__`
(`parallel.specs`) reads the fields the key fixes and none of the names, save three: a group
name and a member target must be non-empty, and a group lists each target once.
`renamed_group` checks those three on the new names (dense targets and stored targets alike)
and returns None when one fails, so that instance is built in full and raises exactly the
error an uncached build raises. Every other check ran once, on the template, with values equal
to this instance's: a renamed copy is what the full build would have produced, so its fields
are copied with `unchecked_replace` instead of being validated again.

**The evaluation memo.** Computing an instance's values evaluates expressions too; those are
memoized by the values of the names they actually read (an instance's values are a function
of those and nothing else, as expressions are pure): `InstanceValues` by the read set recorded
while the first instance evaluated (`_Reads`), single evaluations by the expression and the
typed values of its names (`env_key`). A value that is not a plain int, str, bool, None or a
tuple of them is never memoized.

**Fallback to a full build**: when the cache is off (`BindCache(enabled=False)`, what the
differential tests compare against), when evaluating an instance's values or names raises
(the full build raises the first error in its own order), when module paths cannot be
summarized as `<module>.<param>` targets (an empty path, a fused group without two modules),
when the structure is new, and when a renamed copy would fail a name check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from partc.parallel.placements import unchecked_replace

if TYPE_CHECKING:
    from partc.bind.linear_formats import MemberSource
    from partc.family.expr import Expression
    from partc.parallel.specs import ParameterGroupSpec

Value = Any

MAX_READ_SETS = 16
"""Most distinct sets of names one declaration's values are memoized under."""


def env_key(env: Mapping[str, Value], names: Iterable[str]) -> tuple[object, ...] | None:
    """The type and value of each of `names` in `env`, or the name alone when unbound (None:
    one holds a value that is not plainly comparable). Evaluation reads nothing else."""
    key: list[object] = []
    for name in names:
        if name not in env:
            key.append((name,))
            continue
        value = _typed(env[name])
        if value is None:
            return None
        key.append(value)
    return tuple(key)


def _typed(value: Value) -> tuple[object, ...] | None:
    """`value` tagged with its type, so that `True` and `1` differ (None: not a plain value)."""
    kind = type(value)
    if kind is int or kind is str or kind is bool or value is None:
        return (kind, value)
    if kind is tuple:
        items = tuple(_typed(item) for item in value)
        return None if None in items else (kind, items)
    return None


@dataclass(frozen=True, slots=True)
class StructureKey:
    """What a group instance's full build reads besides its names: see the module docstring."""

    declaration: str
    """Pointer of the group declaration in the family document."""
    values: int
    """Number of the instance's evaluated values among its declaration's (`InstanceValues`)."""
    fused_prefix: tuple[bool, ...]
    """Per dense member target: whether the fused output module's path starts it (fused)."""
    format_facts: tuple[object, ...]
    """What expanding under the linear format reads of the dense member targets."""


@dataclass(frozen=True, slots=True)
class InstanceValues:
    """What an instance of a declaration evaluates besides its names."""

    ident: int
    """Equal for equal values (of one declaration)."""
    layout: tuple[Any, ...]
    """The declarations (members, or modules and their parameter names) whose names make the
    member targets, in order."""


@dataclass(frozen=True, slots=True)
class GroupTemplate:
    """A group built and validated in full and, per stored member, where its target is from."""

    group: ParameterGroupSpec
    """The group in its stored representation (linear formats expanded)."""
    sources: tuple[MemberSource, ...]
    """Per member: the dense member whose target its own is made from, and how."""


class _Reads(Mapping[str, Value]):
    """An environment that records the names looked up in it, in order."""

    def __init__(self, env: Mapping[str, Value]) -> None:
        self.env = env
        self.names: dict[str, None] = {}

    def __getitem__(self, name: str) -> Value:
        self.names[name] = None
        return self.env[name]

    def __contains__(self, name: object) -> bool:
        self.names[str(name)] = None
        return name in self.env

    def __iter__(self) -> Iterator[str]:
        self.names.update(dict.fromkeys(self.env))
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


EvaluationKey = tuple[str, frozenset[str], tuple[object, ...]]
"""An expression's text and names (what `Expression` equality compares: equal expressions
evaluate alike) and the `env_key` of those names. Plain fields rather than the `Expression`,
whose generated `__hash__` would cost a Python call per evaluation."""

_ReadTable = dict[object, InstanceValues]
"""Instance values by the `env_key` of one read set."""


@dataclass(slots=True)
class BindCache:
    """The memos and templates of one bind; `enabled=False` makes every lookup miss."""

    enabled: bool = True
    """Whether anything is memoized (False: every instance evaluated and built in full)."""
    evaluations: dict[EvaluationKey, Value] = field(default_factory=dict)
    """Successful evaluations by `EvaluationKey`."""
    templates: dict[StructureKey, GroupTemplate] = field(default_factory=dict)
    """Groups built in full, by structure."""
    read_sets: dict[str, list[tuple[tuple[str, ...], _ReadTable]]] = field(
        default_factory=dict)
    """Per declaration pointer: the names its values read, and its values by theirs."""
    value_idents: dict[str, dict[tuple[object, ...], int]] = field(default_factory=dict)
    """Per declaration pointer: a number for each distinct evaluation."""

    def evaluation_key(self, expr: Expression, env: Mapping[str, Value]) -> EvaluationKey | None:
        """The memo key of evaluating `expr` in `env` (None: not memoized)."""
        if not self.enabled:
            return None
        values = env_key(env, expr.names)
        return None if values is None else (expr.text, expr.names, values)

    def instance_values(self, declaration: str, env: Mapping[str, Value],
                        evaluate: Callable[[Mapping[str, Value]],
                                           tuple[tuple[object, ...], tuple[Any, ...]]]
                        ) -> InstanceValues:
        """`evaluate(env)` (values, layout) of an instance of `declaration`, numbered, and
        memoized by the values of the names it read: evaluation is deterministic, so an
        instance agreeing on those reads the same and agrees."""
        tables = self.read_sets.setdefault(declaration, [])
        for names, table in tables:
            found = table.get(env_key(env, names))
            if found is not None:
                return found
        reads = _Reads(env)
        evaluated, layout = evaluate(reads)
        idents = self.value_idents.setdefault(declaration, {})
        result = InstanceValues(ident=idents.setdefault(evaluated, len(idents)), layout=layout)
        names = tuple(reads.names)
        key = env_key(env, names)
        if key is None:
            return result
        same = next((table for known, table in tables if known == names), None)
        if same is None:
            if len(tables) == MAX_READ_SETS:
                return result
            same = {}
            tables.append((names, same))
        same[key] = result
        return result


def renamed_group(template: GroupTemplate, name: str,
                  targets: tuple[str, ...]) -> ParameterGroupSpec | None:
    """`template.group` for another instance: group `name`, dense member targets `targets`.

    None when a name check of the full build would fail (an empty or repeated name).
    """
    stored = [targets[index] + suffix if not strip else targets[index][:-strip] + suffix
              for index, strip, suffix in template.sources]
    if not (name and all(targets) and all(stored) and len(set(targets)) == len(targets)
            and len(set(stored)) == len(stored)):
        return None
    group = template.group
    members = tuple(member if member.target == target else
                    unchecked_replace(member, target=target)  # checks are name-blind
                    for member, target in zip(group.members, stored, strict=True))
    return unchecked_replace(group, name=name, members=members)
