"""Errors carry their location from construction: a stage that learns where a lower stage's
error is creates a located copy, never edits the error it caught."""

from __future__ import annotations

import pytest

from partc.errors import (
    ExpressionError,
    ParallelPlanError,
    ParallelPlanErrorKind,
    PartcError,
    SourceLocation,
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

    from partc.api import compile_family
    from partc.errors import CheckpointError, CheckpointErrors, LayoutError, PartcErrors

    from support import hf, import_build

    compile_family(None, hf("llama") / "config.json", tensor_parallel_size=2,
                   checkpoint=hf("llama"), out=tmp_path / "b")
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
