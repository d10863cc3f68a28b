"""Checks of generated code: a rendered module may hold only the shapes partc's templates emit."""

from __future__ import annotations

import ast

from partc.errors import EmitError

_ALLOWED_IMPORTS = {
    "from __future__ import annotations",
    "from partc import runtime as _runtime",
}


_TABLE_CALL = "_runtime.RankTable"


class _GeneratedCodeChecker:
    """Walks a rendered module and refuses anything but the shapes partc's templates emit.

    Allowed: a docstring; `from __future__ import annotations` and `from partc import runtime
    as _runtime`; `NAME = <literal>` (constants, tuples, lists, dicts, negative numbers) or
    `NAME = _runtime.RankTable(field=NAME, ...)`; and functions whose body is a docstring and
    `return _runtime.<function>(...)` with plain names and literals as arguments. Every name
    read must be a parameter, an earlier module constant, `_runtime` or `__name__`. So a string
    from a family, config or checkpoint can only ever appear as a literal.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.constants: set[str] = set()

    def fail(self, node: ast.AST, what: str) -> EmitError:
        line = getattr(node, "lineno", 0)
        return EmitError(f"generated module {self.name} has {what} at line {line}")

    def module(self, tree: ast.Module) -> None:
        for index, node in enumerate(tree.body):
            if isinstance(node, ast.Expr):
                if index != 0 or not _is_docstring(node):
                    raise self.fail(node, "an expression statement")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                if ast.unparse(node) not in _ALLOWED_IMPORTS:
                    raise self.fail(node, f"an unexpected import `{ast.unparse(node)}`")
            elif isinstance(node, ast.Assign):
                self.assignment(node)
            elif isinstance(node, ast.FunctionDef):
                self.function(node)
            else:
                raise self.fail(node, f"an unexpected {type(node).__name__} statement")

    def assignment(self, node: ast.Assign) -> None:
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            raise self.fail(node, "an assignment to something other than one name")
        value = node.value
        if isinstance(value, ast.Call):
            if ast.unparse(value.func) != _TABLE_CALL or value.args:
                raise self.fail(node, f"an import-time call of `{ast.unparse(value.func)}`")
            for keyword in value.keywords:
                if keyword.arg is None or not self.is_name(keyword.value, self.constants):
                    raise self.fail(node, f"an unexpected argument to {_TABLE_CALL}")
        elif not _is_literal(value):
            raise self.fail(node, f"a non-literal value for `{node.targets[0].id}`")
        self.constants.add(node.targets[0].id)

    def function(self, node: ast.FunctionDef) -> None:
        arguments = node.args
        if node.decorator_list or node.returns is not None or arguments.vararg \
                or arguments.posonlyargs or arguments.kwonlyargs:
            raise self.fail(node, f"an unexpected signature for `{node.name}`")
        if not all(_is_literal(default) for default in arguments.defaults):
            raise self.fail(node, f"a non-literal default in `{node.name}`")
        params = {a.arg for a in arguments.args if a.annotation is None}
        if len(params) != len(arguments.args):
            raise self.fail(node, f"an annotated parameter in `{node.name}`")
        if arguments.kwarg is not None:
            params.add(arguments.kwarg.arg)
        body = node.body[1:] if node.body and _is_docstring(node.body[0]) else node.body
        if len(body) != 1 or not isinstance(body[0], ast.Return):
            raise self.fail(node, f"a body other than `return _runtime.<function>(...)` in "
                            f"`{node.name}`")
        call = body[0].value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "_runtime"):
            raise self.fail(body[0], f"a return of something other than a `_runtime` call in "
                            f"`{node.name}`")
        names = params | self.constants | {"__name__"}
        for arg in call.args:
            if not (self.is_name(arg, names) or _is_literal(arg)):
                raise self.fail(arg, f"an unexpected argument in `{node.name}`")
        for keyword in call.keywords:
            if keyword.arg is None and not (arguments.kwarg is not None and isinstance(
                    keyword.value, ast.Name) and keyword.value.id == arguments.kwarg.arg):
                raise self.fail(keyword, f"an unexpected `**` argument in `{node.name}`")
            if not (self.is_name(keyword.value, names) or _is_literal(keyword.value)):
                raise self.fail(keyword, f"an unexpected argument in `{node.name}`")

    @staticmethod
    def is_name(node: ast.AST, names: set[str]) -> bool:
        return isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _is_literal(node: ast.AST) -> bool:
    """Whether `node` is a literal python_literal can emit (no names, calls or operators)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str | int | float | bool | type(None))
    if isinstance(node, ast.UnaryOp):
        return (isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
                and isinstance(node.operand.value, int | float)
                and not isinstance(node.operand.value, bool))
    if isinstance(node, ast.Tuple | ast.List):
        return all(_is_literal(item) for item in node.elts)
    if isinstance(node, ast.Dict):
        return all(key is not None and _is_literal(key) for key in node.keys) and all(
            _is_literal(value) for value in node.values)
    return False


def check_generated(source: str, name: str) -> None:
    """Parse a rendered module and check it holds only the statement shapes partc emits (the
    checker admits nothing a successful parse could still fail to compile)."""
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError as exc:
        raise EmitError(f"generated module {name} does not compile: {exc.msg} (line "
                        f"{exc.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise EmitError(f"generated module {name} cannot be parsed: {exc}") from None
    _GeneratedCodeChecker(name).module(tree)
