"""Errors carry their location from construction: a stage that learns where a lower stage's
error is creates a located copy, never edits the error it caught."""

from __future__ import annotations

import inspect

import pytest

import partc.errors as errors_module
from partc.errors import (
    STAGES,
    ArchitectureBoundaryError,
    ArchitectureBoundaryErrorKind,
    ArchitecturePartitionError,
    ArchitecturePartitionErrorKind,
    BoundaryPayloadError,
    CheckpointError,
    CheckpointErrors,
    ExecutorError,
    ExpressionError,
    LaunchError,
    LayoutError,
    LoadError,
    ParallelPlanError,
    ParallelPlanErrorKind,
    PartcError,
    PartcErrors,
    SemanticError,
    SourceLocation,
    raise_if_any,
)


def test_location_pointer_and_tensor_cannot_be_assigned():
    error = PartcError("bad", location=SourceLocation("f.yaml", 3, 4), pointer="/a", tensor="t")
    for name in ("location", "pointer", "tensor"):
        with pytest.raises(AttributeError):
            setattr(error, name, None)
    assert (error.location, error.pointer, error.tensor) == (SourceLocation("f.yaml", 3, 4),
                                                             "/a", "t")


def test_located_creates_a_new_error_of_the_same_kind_and_fields():
    caught = ParallelPlanError(ParallelPlanErrorKind.INVALID_GROUP, "group `g` is bad",
                               group="g", pointer="/x")
    where = SourceLocation("family.yaml", 7, 2)
    located = caught.located(where, "/parameters/1")
    assert located is not caught and type(located) is ParallelPlanError
    assert (located.kind, located.group, located.message, located.args) == (
        caught.kind, caught.group, caught.message, caught.args)
    assert str(located) == "family.yaml:7:2: group `g` is bad [at /parameters/1]"
    assert (caught.location, caught.pointer) == (None, "/x")  # the caught error is unchanged
    assert caught.located(where).pointer == "/x"  # no pointer given: its own is kept


def test_an_expression_error_located_keeps_its_offset_and_text():
    caught = ExpressionError("division by zero", expression="a // 0", offset=2)
    located = caught.located(SourceLocation("f.yaml", 1, 9), "/config/x/default")
    assert (located.expression, located.offset, located.to_json()["line"]) == ("a // 0", 2, 1)


def test_a_checkpoint_with_several_problems_is_still_a_checkpoint_error(tmp_path):
    # two tensors missing: the header check reports both
    from safetensors.numpy import load_file, save_file

    from partc.api import CompileOptions, compile_family
    from partc.errors import CheckpointError, CheckpointErrors, LayoutError, PartcErrors
    from partc.plan.topology import Topology

    from support import hf, import_build

    compile_family(None, hf("llama") / "config.json", Topology(tensor_parallel_size=2),
                   CompileOptions(checkpoint=hf("llama"), out=tmp_path / "b"))
    tensors = load_file(str(hf("llama") / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    del tensors["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "ck").mkdir()
    save_file(tensors, str(tmp_path / "ck" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as caught:
        import_build(tmp_path / "b").load(tmp_path / "ck", rank=0)
    error = caught.value
    assert isinstance(error, CheckpointErrors) and isinstance(error, PartcErrors)
    assert len(error.errors) >= 2 and all(isinstance(e, CheckpointError) for e in error.errors)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        assert any(name in str(e) for e in error.errors), name
    # a mix of kinds stays a plain PartcErrors, which `except CheckpointError` must not catch
    mixed = PartcErrors([CheckpointError("a"), LayoutError("b")])
    assert type(mixed) is PartcErrors and not isinstance(mixed, CheckpointError)


@pytest.mark.parametrize(("location", "message", "tensor", "shown"), [
    (SourceLocation("m.safetensors"), "dtype/shape byte-size mismatch", "a.weight",
     "m.safetensors (tensor a.weight): dtype/shape byte-size mismatch"),
    (SourceLocation("f.yaml", 3, 4), "bad [x]", "a.b", "f.yaml:3:4 (tensor a.b): bad [x]"),
    (None, "bad", "a.b", "tensor a.b: bad"),
    (SourceLocation("m.safetensors"), "tensor `a.b` is F16", "a.b", "m.safetensors: tensor "
     "`a.b` is F16"),
    (SourceLocation("m.safetensors"), "tensor 'a.b' is in two shards", "a.b",
     "m.safetensors: tensor 'a.b' is in two shards"),
    (SourceLocation("m.safetensors"), "tensor `a.bc` differs", "a.b",
     "m.safetensors (tensor a.b): tensor `a.bc` differs"),
    (SourceLocation("m.safetensors"), "bad", "a\nb", "m.safetensors (tensor 'a\\nb'): bad"),
])
def test_the_shown_error_names_its_tensor_unless_the_message_quotes_it(
        location, message, tensor, shown):
    error = PartcError(message, location=location, tensor=tensor)
    assert str(error) == shown
    assert error.message == message and error.tensor == tensor  # the fields stay apart


# ---------------------------------------------------------------- one class per stage


def _error_classes() -> list[type[PartcError]]:
    """Every PartcError subclass of the package, once every module of it is imported."""
    import importlib
    import pkgutil

    import partc

    for module in pkgutil.walk_packages(partc.__path__, "partc."):
        if not module.name.endswith("__main__"):  # the command line's entry point runs it
            importlib.import_module(module.name)
    found, todo = [], [PartcError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(set(found), key=lambda c: c.__name__)


def test_every_error_class_has_the_stage_of_the_one_stage_class_it_derives_from():
    assert len(set(STAGES.values())) == len(STAGES), "one class per stage"
    for stage, root in STAGES.items():
        assert root.stage == stage, root
    for cls in _error_classes():
        roots = [c for c in cls.__mro__ if c in STAGES.values()]
        if cls in (PartcError, PartcErrors):
            assert roots == [] and cls.stage == "partc"
            continue
        assert roots, f"{cls.__name__} derives from no stage class"
        assert cls.stage == roots[0].stage, f"{cls.__name__}: {cls.stage} != {roots[0].stage}"
        # stage classes nest (LaunchError is a CheckpointError), they never cross: a class
        # of two stages that are not one inside the other would be caught by both
        assert all(issubclass(a, b) for a, b in zip(roots, roots[1:], strict=False)), cls


def test_every_error_class_lives_in_partc_errors_and_derives_from_partc_error():
    assert {c.__module__ for c in _error_classes()} == {"partc.errors"}
    exceptions = [v for v in vars(errors_module).values()
                  if isinstance(v, type) and issubclass(v, BaseException)]
    assert exceptions and all(issubclass(c, PartcError) for c in exceptions)


def test_the_stage_is_a_class_constant_not_a_per_error_field():
    many = PartcErrors([CheckpointError("a", tensor="x"), CheckpointError("b", tensor="y")])
    assert type(many) is CheckpointErrors and CheckpointErrors.stage == "runtime"
    mixed = PartcErrors([LoadError("late", location=SourceLocation("f", 9, 1)),
                         LayoutError("early", location=SourceLocation("f", 2, 1))])
    assert type(mixed) is PartcErrors and "stage" not in vars(mixed)
    assert mixed.to_json()["stage"] == "plan" and mixed.to_json()["kind"] == "LayoutError"


def test_every_constructor_names_its_keywords():
    for cls in _error_classes():
        parameters = inspect.signature(cls.__init__).parameters.values()
        assert all(p.kind is not p.VAR_KEYWORD for p in parameters), cls.__name__
    with pytest.raises(TypeError):
        ParallelPlanError(ParallelPlanErrorKind.INVALID_GROUP, "m", stage="plan")  # type: ignore[call-arg]


def test_except_layout_error_catches_a_partition_that_cannot_be_realized():
    error = ArchitecturePartitionError(ArchitecturePartitionErrorKind.INVALID_STAGES,
                                       "stage 2 is outside 0..1")
    with pytest.raises(LayoutError) as caught:
        raise error
    assert caught.value.stage == "plan" and caught.value.doc == "boundaries#units-and-stages"


def test_a_boundary_schema_and_a_boundary_payload_are_errors_of_their_own_stages():
    schema = ArchitectureBoundaryError(ArchitectureBoundaryErrorKind.INVALID_SCHEMA, "m")
    payload = BoundaryPayloadError(ArchitectureBoundaryErrorKind.WRONG_DTYPE, "m")
    assert isinstance(schema, SemanticError) and schema.stage == "family"
    assert isinstance(payload, ExecutorError) and payload.stage == "executor"
    with pytest.raises(ValueError, match="payload problem"):
        ArchitectureBoundaryError(ArchitectureBoundaryErrorKind.WRONG_DTYPE, "m")
    with pytest.raises(ValueError, match="schema problem"):
        BoundaryPayloadError(ArchitectureBoundaryErrorKind.INVALID_SCHEMA, "m")


@pytest.mark.parametrize(("rank", "world", "message"), [
    ("5", None, "RANK=5 is outside this build's ranks 0..3 (WORLD_SIZE is not set: one replica)"),
    ("8", "8", "RANK=8 is outside WORLD_SIZE=8"),
    ("1", "6", "WORLD_SIZE=6"),
])
def test_a_wrong_rank_or_world_size_is_a_launch_error(monkeypatch, rank, world, message):
    from partc.runtime.rank_env import launch_position

    monkeypatch.setenv("RANK", rank)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(LaunchError) as caught:
        launch_position(4)
    assert message in str(caught.value)
    assert caught.value.to_json()["stage"] == "launch"
    assert isinstance(caught.value, CheckpointError), "existing `except CheckpointError` code"


def test_raise_if_any_raises_nothing_the_one_error_or_all_of_them_sorted():
    raise_if_any([])
    one = LoadError("bad", location=SourceLocation("f.yaml", 3, 1))
    with pytest.raises(LoadError) as caught:
        raise_if_any([one])
    assert caught.value is one
    late = SemanticError("late", location=SourceLocation("f.yaml", 9, 1))
    with pytest.raises(PartcErrors) as many:
        raise_if_any((late, one))
    assert many.value.errors == [one, late] and many.value.message == "bad"
