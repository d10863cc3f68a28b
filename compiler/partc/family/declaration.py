"""Stage 3: turn a schema-valid document into a symbolic family declaration and check it.

Every expression and template is parsed here (never evaluated: that is `bind`'s job), and every
name an expression uses is checked against the config fields and the loop variables in scope,
so a typo is reported with its file and line before any config.json is read.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from partc.errors import PartcError
from partc.family.expr import Expression, Template
from partc.parallel.layout import ParameterRole
from partc.parallel.specs import (
    FusedLayout,
    LinearWeightLayout,
    MemberShardingKind,
    ProjectionSharding,
    ShardingPolicy,
)
from partc.partition.boundary import BoundaryTensorDimensionKind, BoundaryTensorDtype
from partc.partition.ownership import GroupParallelMode, StageSide

if TYPE_CHECKING:
    from partc.front.load import RawDocument

UNIT_VARIABLE = "unit"
"""The loop variable bound to the unit index of a unit-owned group."""
UNIT_PATH_VARIABLE = "path"
"""The variable bound to the unit's path (e.g. `model.layers.7`) in a unit-owned group."""
UNIT_GROUP_VARIABLE = "group"
"""The variable bound to the execution group's name in a unit-owned group."""
UNIT_VARIABLES = (UNIT_VARIABLE, UNIT_PATH_VARIABLE, UNIT_GROUP_VARIABLE)
"""Every variable a unit-owned group sees besides the config fields."""
HEAD_VARIABLE = "head"
"""The variable bound to the head index in the path of a `sharding: per_head` projection."""


class ConfigType(enum.Enum):
    """The type a config field declares (`type:`), which its config.json value must have."""

    INT = "int"
    BOOL = "bool"
    STR = "str"
    FLOAT = "float"
    INT_LIST = "int_list"
    STR_LIST = "str_list"
    ANY = "any"


CONFIG_TYPES = tuple(t.value for t in ConfigType)
"""Types a config field may declare, as written."""


class OwnerKind(enum.Enum):
    """The key an owner choice uses: one static role, any of several, or the units of groups."""

    STATIC = "static"
    ANY_OF = "any_of"
    UNIT = "unit"


class GroupForm(enum.Enum):
    """How a parameter group declares its members: the one of these keys it uses."""

    MEMBERS = "members"
    """An explicit list of members, each with its own target, shape and sharding."""
    MODULE = "module"
    """One module's parameters, all sharded by one rule."""
    PROJECTIONS = "projections"
    """Column- or row-parallel projections (modules with parameters)."""
    FUSED = "fused"
    """A fused column projection of segments and its row-parallel output module."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigFieldDecl:
    """A field read from config.json: type, default and where to read it."""

    name: str
    """Name used in expressions."""
    type: ConfigType
    """The declared type."""
    default: Expression | None
    """Value when config.json lacks the field (None: the field is required)."""
    sources: tuple[str, ...]
    """Dotted paths in config.json, first present wins."""
    pointer: str
    """Where the field is declared."""
    present: Template | None = None
    """A bool field probing the checkpoint: true when it holds this tensor (None: no probe)."""
    literal_default: tuple[bool, Any] = (False, None)
    """(True, value) for a float default, which is kept as a value rather than an expression."""
    nullable: bool = False
    """Whether null in config.json is a value of the field (else null reads as a missing key)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DerivedDecl:
    """A named value computed from config fields and other derived values (`derived:`)."""

    name: str
    """Name used in expressions."""
    expression: Expression
    """How it is computed."""
    pointer: str
    """Where it is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphGroupDecl:
    """A declared execution group."""

    name: str
    """Group name."""
    units: Expression
    """Number of units."""
    path: Template
    """Unit path template (`{unit}`)."""
    carries_state: bool
    """Whether units carry KV state."""
    after: tuple[str, ...]
    """Dependencies."""
    pointer: str
    """Where the group is declared."""
    boundary_identity: str = ""
    """Identity of the boundary crossing a cut after one of its units ('' : the family's)."""
    boundary: tuple[BoundaryTensorDecl, ...] = ()
    """Primary then auxiliary tensors of that boundary (empty: the family-level boundary)."""
    weight: Expression | None = None
    """Declared pipeline cost of one unit (None: not declared)."""
    parallel: GroupParallelMode | None = None
    """Declared parallel mode (None: split)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixDecl:
    """An alternative on-disk name prefix (`prefixes:`): a string value chosen by what the
    checkpoint holds."""

    name: str
    """Name used in templates and expressions."""
    candidates: tuple[str, ...]
    """Prefixes in order of preference."""
    default: str
    """The value without a checkpoint."""
    pointer: str
    """Where it is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerDecl:
    """One owner choice of a parameter group; the first whose `when` holds is used."""

    kind: OwnerKind
    """Which owner key the choice uses."""
    roles: tuple[str, ...]
    """Static role(s)."""
    group: str | None
    """Execution group for 'unit' (the first, when several are listed)."""
    when: Expression | None
    """Condition, if any."""
    pointer: str
    """Where the choice is declared."""
    groups: tuple[str, ...] = ()
    """Every execution group for 'unit': the group is instantiated once per unit of each."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicatedShardingDecl:
    """A declared `replicated` member rule: every rank holds the whole tensor."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.REPLICATED
    partitions: ClassVar[bool] = False
    """Whether the rule partitions its axis over the group's units."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AxisShardingDecl:
    """What the declared `{equal|balanced|partitioned: AXIS}` rules share: an axis alone."""

    kind: ClassVar[MemberShardingKind]
    partitions: ClassVar[bool] = False
    segments: ClassVar[tuple[Expression, ...]] = ()
    axis: int
    """The split axis."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EqualShardingDecl(AxisShardingDecl):
    """A declared `{equal: AXIS}`: equal contiguous shards."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.EQUAL


@dataclass(frozen=True, slots=True, kw_only=True)
class BalancedShardingDecl(AxisShardingDecl):
    """A declared `{balanced: AXIS}`: balanced, possibly uneven, contiguous ranges."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.BALANCED


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionedShardingDecl(AxisShardingDecl):
    """A declared `{partitioned: AXIS}`: the group's logical partition mapped onto the axis."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.PARTITIONED
    partitions: ClassVar[bool] = True


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentsShardingDecl:
    """What the declared `{partitioned_segments|segmented: {axis, segments}}` rules share."""

    kind: ClassVar[MemberShardingKind]
    partitions: ClassVar[bool] = False
    axis: int
    """The split axis."""
    segments: tuple[Expression, ...]
    """Fused segment widths along the axis (expressions over config names)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionedSegmentsShardingDecl(SegmentsShardingDecl):
    """A declared `partitioned_segments`: the group's logical range mapped into each segment."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.PARTITIONED_SEGMENTS
    partitions: ClassVar[bool] = True


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentedShardingDecl(SegmentsShardingDecl):
    """A declared `segmented`: each segment split over the ranks on its own."""

    kind: ClassVar[MemberShardingKind] = MemberShardingKind.SEGMENTED


SplitShardingDecl = (EqualShardingDecl | BalancedShardingDecl | PartitionedShardingDecl
                     | PartitionedSegmentsShardingDecl | SegmentedShardingDecl)
"""A declared rule that splits an axis."""
ShardingDecl = ReplicatedShardingDecl | SplitShardingDecl
"""A symbolic member sharding rule: one class per kind (as `MemberSharding` once bound)."""

AXIS_SHARDING_DECLS: Mapping[MemberShardingKind, type[
        EqualShardingDecl | BalancedShardingDecl | PartitionedShardingDecl]] = {
    cls.kind: cls for cls in (EqualShardingDecl, BalancedShardingDecl, PartitionedShardingDecl)}
"""The declaration class of each kind written `{kind: AXIS}`."""
SEGMENTS_SHARDING_DECLS: Mapping[MemberShardingKind, type[
        PartitionedSegmentsShardingDecl | SegmentedShardingDecl]] = {
    cls.kind: cls for cls in (PartitionedSegmentsShardingDecl, SegmentedShardingDecl)}
"""The declaration class of each kind written `{kind: {axis: AXIS, segments: [...]}}`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamDecl:
    """A parameter of a module (or a member): name or target, shape, condition, dtype."""

    name: Template
    """Parameter name (module forms) or full target template (member form)."""
    shape: tuple[Expression, ...]
    """Symbolic shape."""
    when: Expression | None
    """Condition for the parameter to exist."""
    dtype: Expression | None
    """Stored dtype override."""
    sharding: ShardingDecl | None
    """Explicit sharding (member form only)."""
    pointer: str
    """Where it is declared."""
    layout: LinearWeightLayout | None = None
    """Member form `format:` linear or linear_transposed (None: dense, not a linear weight)."""
    heads: tuple[Expression, ...] = ()
    """Member form `heads:`: head counts along the partitioned axis (one per segment)."""
    tp_reduction: bool = False
    """Member form `reduction: tensor_parallel`: a split norm weight whose statistic spans every
    rank's channels (Bamba's gated Mamba2 RMSNorm with one group)."""
    tp_output_reduction: bool = False
    """Member form `reduction: output`: the member's module output is all-reduced over the TP
    group inside the enclosing module (a row-split `x_proj`)."""
    shape_pointer: str = ""
    """Where the shape list is declared; dimension i is at `shape_pointer/i` ('' if unknown)."""

    def dimension_pointer(self, index: int) -> str:
        """The pointer of shape dimension `index` (the parameter's pointer if unknown)."""
        return f"{self.shape_pointer}/{index}" if self.shape_pointer else self.pointer


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleDecl:
    """A module with parameters: a projection, a fused projection or a plain module."""

    module: Template
    """Module path template."""
    params: tuple[ParamDecl, ...]
    """Its parameters."""
    sharding: ProjectionSharding | None
    """Projection sharding (projections only)."""
    segments: tuple[Expression, ...]
    """Segment widths (fused projections only)."""
    when: Expression | None
    """Condition for the module to exist."""
    linear: bool
    """Whether a linear format may encode its weight."""
    pointer: str
    """Where it is declared."""
    heads: tuple[Expression, ...] = ()
    """`heads:` hint: head count of the split axis (one per segment for a fused projection)."""
    layout: FusedLayout = FusedLayout.COMPONENT_MAJOR
    """Row order of a fused projection's segments (`layout:`)."""
    groups: Expression | None = None
    """`groups:` the group count of a `grouped` fused layout (None otherwise)."""
    orientation: LinearWeightLayout = LinearWeightLayout.OUT_IN
    """How the weight stores its matrix axes (`orientation: in_out`: a GPT-2 Conv1D)."""
    tp_reduction: bool = False
    """`reduction: tensor_parallel`: a norm whose statistic spans the split projection."""
    tp_output_reduction: bool = False
    """`reduction: output` on a row projection: its output is all-reduced over the TP group
    inside its module, before further per-channel work (Mamba's `x_proj`)."""
    per_head: bool = False
    """`sharding: per_head`: one module per head (`heads:` of them, `{head}` in its path),
    each whole on the ranks holding its head and absent on the others."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupDecl:
    """A declared parameter group (one YAML entry, possibly repeated over units and loops)."""

    name: Template
    """Logical name template."""
    role: ParameterRole
    """Semantic role."""
    owners: tuple[OwnerDecl, ...]
    """Owner choices."""
    when: Expression | None
    """Per-instance condition."""
    loops: tuple[tuple[str, Expression], ...]
    """Repetition variables and their counts."""
    units: Expression | None
    """Partition units."""
    units_text: str
    """The units expression as written, for messages."""
    policy: ShardingPolicy | None
    """Per-group policy."""
    kv_replication: bool
    """Whether KV heads may repeat across ranks."""
    form: GroupForm
    """How the members are declared."""
    members: tuple[ParamDecl, ...]
    """Members (form 'members')."""
    module: ModuleDecl | None
    """The module (form 'module')."""
    module_sharding: ShardingDecl | None
    """Rule of every parameter (form 'module')."""
    projections: tuple[ModuleDecl, ...]
    """Projections (form 'projections'), or the fused projection and its output ('fused')."""
    pointer: str
    """Where the group is declared."""
    expert_axis: int | None = None
    """`experts: {axis: N}`: the group stacks every routed expert along axis N of each member
    (None: not stacked; a per-expert group instead has the loop variable `expert`)."""
    expert_count: Expression | None = None
    """`experts: {count: ...}`: the experts the expert axis holds, each a block of
    `axis length / count` rows (`[E * I, H]`); None: one row (or slice) per expert."""

    @property
    def expert_loop(self) -> bool:
        """Whether the group is one routed expert (it loops over `EXPERT_VARIABLE`)."""
        return any(var == EXPERT_VARIABLE for var, _ in self.loops)


EXPERT_VARIABLE = "expert"
"""The loop variable whose value is a per-expert group's global expert id."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryTensorDecl:
    """A declared boundary tensor."""

    role: str
    """Role."""
    shape: tuple[BoundaryTensorDimensionKind | Expression | str, ...]
    """BATCH, SEQUENCE, an expression for a fixed size, or a per-request dimension's name."""
    dtype: BoundaryTensorDtype
    """The element type."""
    pointer: str
    """Where it is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearFormatDecl:
    """A declared checkpoint encoding of linear weights."""

    format: str
    """dense, block_fp8, mlx_affine, mxfp4 or gguf."""
    when: Expression | None
    """Condition selecting it."""
    options: tuple[tuple[str, Any], ...]
    """Remaining keys (block, bits, ...), expressions parsed."""
    pointer: str
    """Where it is declared."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateSplitDecl:
    """How a state tensor is split: axis `axis` follows a parameter group's logical range."""

    parameters: Template
    """The parameter group (a name template over the unit's variables) it follows."""
    axis: int
    """The state axis that is split."""
    segments: tuple[Expression, ...] = ()
    """Segment widths along `axis`, each split alike (empty: the axis is one segment)."""
    heads: tuple[Expression, ...] = ()
    """Head counts of the segments (empty: none declared, every element its own head)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateDecl:
    """A declared runtime state tensor of every unit of an execution group (`state:`)."""

    name: str
    """State name (e.g. `conv`, `ssm`, `key`)."""
    group: str
    """The execution group whose units carry it."""
    when: Expression | None
    """Condition over the unit (None: every unit)."""
    shape: tuple[Expression, ...]
    """Global shape of one unit's tensor."""
    dtype: Expression | None
    """Its dtype expression (None: the activation dtype)."""
    split: StateSplitDecl | None
    """How a tensor-parallel rank splits it (None: replicated)."""
    pointer: str
    """Where it is declared."""
    per_token: bool = False
    """One tensor per token of the sequence (a KV cache entry), not one per sequence."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyDecl:
    """A checked symbolic family: what a YAML or TOML file declares."""

    name: str
    """Family name."""
    model_types: tuple[str, ...]
    """HF model types it describes."""
    config: tuple[ConfigFieldDecl, ...]
    """Config fields."""
    graph: tuple[GraphGroupDecl, ...]
    """Execution groups."""
    static_roles: tuple[tuple[str, StageSide], ...]
    """Static roles and sides."""
    groups: tuple[GroupDecl, ...]
    """Parameter groups."""
    boundary_identity: str
    """Boundary schema identity."""
    boundary: tuple[BoundaryTensorDecl, ...]
    """Primary then auxiliary boundary tensors."""
    linear_formats: tuple[LinearFormatDecl, ...]
    """Declared linear formats."""
    policy: ShardingPolicy | None
    """Family default policy."""
    document: RawDocument
    """The source document (for locations)."""
    derived: tuple[DerivedDecl, ...] = ()
    """Named derived values, in declaration order (bound in dependency order)."""
    omit: tuple[str, ...] = ()
    """Globs of checkpoint tensors that are not parameters: loaded by no rank."""
    prefixes: tuple[PrefixDecl, ...] = ()
    """Alternative on-disk name prefixes, chosen against the checkpoint."""
    dimensions: tuple[str, ...] = ()
    """Per-request boundary dimension names (`dimensions:`)."""
    static_with: tuple[tuple[str, str], ...] = ()
    """Static roles placed with a unit of an execution group: (role, group)."""
    state: tuple[StateDecl, ...] = ()
    """Declared runtime state tensors (`state:`), in declaration order."""

    @property
    def value_names(self) -> frozenset[str]:
        """Every name an expression may read besides loop variables: config, derived and
        prefixes."""
        return (frozenset(f.name for f in self.config) | {d.name for d in self.derived}
                | {p.name for p in self.prefixes})

    def locate_error(self, error: PartcError, pointer: str) -> PartcError:
        """`error` as created at this family's source location for `pointer`, when it has
        none of its own (a lower stage's error about the declaration at `pointer`)."""
        if error.location is None or error.location.line == 0:
            return error.located(self.document.locate(pointer), error.pointer or pointer)
        return error
