"""The evaluator of partc's expression language: a syntax tree interpreted with strict types.

Every failure is an `ExpressionError` at the offset of the culprit; integers stay below
`INT_BOUND` at every step.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NoReturn

from partc.errors import ExpressionError
from partc.family.expr_parse import Node
from partc.family.expr_values import (
    INT_BOUND,
    MAX_LIST_LENGTH,
    BadValue,
    Value,
    coerce,
    describe,
    fail,
    format_value,
    is_int,
    is_number,
    kind_name,
    unknown_message,
)
from partc.family.numbers import ROUNDING

_ARITH: dict[str, Callable[[Any, Any], Any]] = {  # ints, and Fractions for + - *
    "+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv,
    "%": operator.mod,
}
_ORDER: dict[str, Callable[[Any, Any], Any]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


def evaluate_tree(root: Node, text: str, env: Mapping[str, Value]) -> Value:
    """The value of the syntax tree of `text` with names bound by `env`; ExpressionError
    (at the offset of the culprit in `text`) otherwise."""
    return _eval(root, _Context(text, env))


@dataclass(frozen=True, slots=True)
class _Context:
    text: str
    env: Mapping[str, Value]

    def fail(self, message: str, offset: int) -> NoReturn:
        fail(self.text, message, offset)

    def src(self, node: Node) -> str:
        return self.text[node.start:node.end]


def _eval(node: Node, ctx: _Context) -> Value:
    kind, kids = node.kind, node.children
    if kind == "literal":
        return node.value
    if kind == "name":
        if node.name not in ctx.env:
            ctx.fail(unknown_message("name", node.name, [str(key) for key in ctx.env]), node.start)
        try:
            return coerce(ctx.env[node.name], f"`{node.name}`")
        except BadValue as bad:
            raise ExpressionError(str(bad), expression=ctx.text, offset=node.start) from None
    if kind == "list":
        return tuple(_eval(kid, ctx) for kid in kids)
    if kind == "arith":
        return _arith(node, ctx)
    if kind in ("compare", "bool"):
        return _compare_chain(node, ctx) if kind == "compare" else _bool_chain(node, ctx)
    if kind == "neg":
        value = _eval(kids[0], ctx)
        if not is_number(value):
            ctx.fail(f"unary `-` needs an integer, found {describe(value)}", node.start)
        return -value
    if kind == "not":
        value = _eval(kids[0], ctx)
        if not isinstance(value, bool):
            ctx.fail(f"`not` needs a bool, found {describe(value)}", node.start)
        return not value
    if kind == "cond":
        body, cond, orelse = kids
        test = _eval(cond, ctx)
        if not isinstance(test, bool):
            hint = ctx.src(cond)
            ctx.fail(f"the condition of `if` must be a bool, found {describe(test)} for "
                     f"`{hint}`; compare explicitly, e.g. `{hint} != null`", cond.start)
        return _eval(body if test else orelse, ctx)
    if kind == "index":
        return _index(node, ctx)
    return _call(node, ctx, [_eval(kid, ctx) for kid in kids])


def _arith(node: Node, ctx: _Context) -> Value:
    acc = _eval(node.children[0], ctx)
    for (op, offset), kid in zip(node.ops, node.children[1:], strict=True):
        rhs = _eval(kid, ctx)
        if _is_list_op(op, acc, rhs):
            acc = _list_op(ctx, op, offset, acc, rhs, ctx.text[node.start:kid.end])
            continue
        if not (is_number(acc) and is_number(rhs)) or (
                op in ("//", "%") and not (is_int(acc) and is_int(rhs))):
            floated = isinstance(acc, Fraction) or isinstance(rhs, Fraction)
            needs = "integers (floor a float first)" if floated else "integers"
            ctx.fail(f"`{op}` needs {needs}, found {describe(acc)} and {describe(rhs)}", offset)
        source = ctx.text[node.start:kid.end]
        if op in ("//", "%") and rhs == 0:
            kind = "division" if op == "//" else "modulo"
            where = "" if kid.kind == "literal" else f" where {ctx.src(kid)} = 0"
            ctx.fail(f"{kind} by zero: `{source}`{where}", offset)
        acc = _ARITH[op](acc, rhs)
        if not -INT_BOUND < acc < INT_BOUND:
            ctx.fail(f"integer overflow: `{source}` = {format_value(acc)} exceeds 2**63", offset)
    return acc


def _is_list_op(op: str, a: Value, b: Value) -> bool:
    """`list + list` (concatenation) or `list * int` / `int * list` (repetition)."""
    if op == "+":
        return isinstance(a, tuple) and isinstance(b, tuple)
    return op == "*" and ((isinstance(a, tuple) and is_int(b))
                          or (is_int(a) and isinstance(b, tuple)))


def _list_op(ctx: _Context, op: str, offset: int, a: Value, b: Value, source: str) -> Value:
    """The concatenation or repetition of lists, refused beyond MAX_LIST_LENGTH elements."""
    parts: tuple[tuple[Value, ...], ...]
    if isinstance(a, tuple) and isinstance(b, tuple):
        parts, times = (a, b), 1
    else:
        items, count = (a, b) if isinstance(a, tuple) else (b, a)
        assert isinstance(items, tuple) and isinstance(count, int)
        if count < 0:
            ctx.fail(f"a list can be repeated 0 or more times, found {count} in `{source}`",
                     offset)
        parts, times = (items,), count
    length = sum(_elements(part) for part in parts) * times
    if length > MAX_LIST_LENGTH:
        ctx.fail(f"`{source}` would build a list of {length} elements (nested lists counted "
                 f"whole); partc accepts at most {MAX_LIST_LENGTH}", offset)
    return tuple(item for _ in range(times) for part in parts for item in part)


def _elements(value: tuple[Value, ...]) -> int:
    """The elements of a list, those of nested lists included (each operand of a list
    operation is a literal or an earlier bounded result, so this stays cheap)."""
    return sum(1 + (_elements(item) if isinstance(item, tuple) else 0) for item in value)


def _bool_chain(node: Node, ctx: _Context) -> Value:
    decisive = node.name == "or"
    for kid in node.children:
        value = _eval(kid, ctx)
        if not isinstance(value, bool):
            ctx.fail(f"`{node.name}` needs bools, found {describe(value)} for `{ctx.src(kid)}`",
                     kid.start)
        if value is decisive:
            return value
    return not decisive


def _equal(a: Value, b: Value) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if is_number(a) and is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def _compare_chain(node: Node, ctx: _Context) -> Value:
    left = _eval(node.children[0], ctx)
    for (op, offset), kid in zip(node.ops, node.children[1:], strict=True):
        right = _eval(kid, ctx)
        if not _compare(ctx, op, offset, left, right):
            return False
        left = right
    return True


def _compare(ctx: _Context, op: str, offset: int, a: Value, b: Value) -> bool:
    if op in ("==", "!="):
        if (a is not None and b is not None and kind_name(a) != kind_name(b)
            and not (is_number(a) and is_number(b))):
            ctx.fail(f"`{op}` compares values of the same type, found {describe(a)} and "
                     f"{describe(b)}", offset)
        return _equal(a, b) == (op == "==")
    if op in ("in", "not in"):
        if isinstance(b, str):
            if not isinstance(a, str):
                ctx.fail(f"`{op}` with a string on the right needs a string on the left, "
                         f"found {describe(a)}", offset)
            found = a in b
        elif isinstance(b, tuple):
            found = any(_equal(a, item) for item in b)
        else:
            ctx.fail(f"`{op}` needs a list or a string on the right, found {describe(b)}",
                     offset)
        return found == (op == "in")
    if (is_number(a) and is_number(b)) or (isinstance(a, str) and isinstance(b, str)):
        return bool(_ORDER[op](a, b))
    ctx.fail(f"`{op}` needs two integers or two strings, found {describe(a)} and "
             f"{describe(b)}", offset)


def _index(node: Node, ctx: _Context) -> Value:
    (target_node, index_node), bracket = node.children, node.ops[0][1]
    target, index = _eval(target_node, ctx), _eval(index_node, ctx)
    if not isinstance(target, (tuple, str)):
        ctx.fail(f"indexing needs a list or a string, found {describe(target)} for "
                 f"`{ctx.src(target_node)}`", bracket)
    if not is_int(index):
        ctx.fail(f"an index must be an integer, found {describe(index)}", index_node.start)
    if not -len(target) <= index < len(target):
        ctx.fail(f"index {index} is out of range for `{ctx.src(target_node)}` of length "
                 f"{len(target)}", bracket)
    return target[index]


def _need_int(ctx: _Context, call: Node, value: Value, arg: Node) -> int:
    if not is_int(value):
        ctx.fail(f"`{call.name}` needs integers, found {describe(value)} for `{ctx.src(arg)}`",
                 arg.start)
    return value


def _call(node: Node, ctx: _Context, values: list[Value]) -> Value:
    func, args, first = node.name, node.children, values[0]
    if func in ("min", "max", "gcd"):
        if len(values) == 1 and isinstance(first, tuple):
            if not first:
                ctx.fail(f"`{func}` of an empty list `{ctx.src(args[0])}`", args[0].start)
            ints = [_need_int(ctx, node, item, args[0]) for item in first]
        else:
            ints = [_need_int(ctx, node, v, arg) for v, arg in zip(values, args, strict=True)]
        return min(ints) if func == "min" else max(ints) if func == "max" else math.gcd(*ints)
    if func == "len":
        if not isinstance(first, (tuple, str)):
            ctx.fail(f"`len` needs a list or a string, found {describe(first)} for "
                     f"`{ctx.src(args[0])}`", args[0].start)
        return len(first)
    if func in ROUNDING:
        if not is_number(first):
            ctx.fail(f"`{func}` needs a number, found {describe(first)} for "
                     f"`{ctx.src(args[0])}`", args[0].start)
        return ROUNDING[func](first)
    a = _need_int(ctx, node, first, args[0])
    if func == "abs":
        return abs(a)
    b = _need_int(ctx, node, values[1], args[1])
    if b <= 0:
        ctx.fail(f"`ceil_div` needs a positive divisor, found {b} for `{ctx.src(args[1])}`",
                 args[1].start)
    return -(-a // b)
