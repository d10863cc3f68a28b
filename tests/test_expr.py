"""Tests of partc's safe expression language and name templates (partc.expr)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partc.errors import ExpressionError
from partc.family import expr as expr_module
from partc.family import expr_parse
from partc.family.expr import MAX_TEXT_LENGTH, constant, parse, parse_template
from partc.family.expr_values import INT_BOUND, MAX_DEPTH, format_value


def ev(text: str, **env: Any) -> Any:
    return parse(text).evaluate(env)


def fails(text: str, **env: Any) -> ExpressionError:
    """The error raised by parsing then evaluating `text` with `env`."""
    with pytest.raises(ExpressionError) as info:
        parse(text).evaluate(env)
    return info.value


def template_fails(text: str, **env: Any) -> ExpressionError:
    with pytest.raises(ExpressionError) as info:
        parse_template(text).render(env)
    assert info.value.expression == text
    return info.value


# ---------------------------------------------------------------- precedence and semantics


@pytest.mark.parametrize(("text", "expected"), [
    ("1 + 2 * 3", 7),
    ("(1 + 2) * 3", 9),
    ("10 - 3 - 2", 5),
    ("10 - (3 - 2)", 9),
    ("100 // 10 // 5", 2),
    ("2 * 7 % 4", 2),
    ("7 % 4 * 2", 6),
    ("7 - 2 + 1", 6),
    ("-2 * 3", -6),
    ("- -3", 3),
    ("2 - -3", 5),
    ("2 * -3", -6),
    ("-3 + 5", 2),
    ("1 + 2 == 3", True),
    ("2 * 3 < 7", True),
    ("1 + 2 in [3]", True),
    ("not 1 == 2", True),
    ("not true and false", False),
    ("not (true and false)", True),
    ("true or false and false", True),
    ("(true or false) and false", False),
    ("false and true or true", True),
    ("1 if true else 2", 1),
    ("1 if false else 2 if true else 3", 2),
    ("1 if false else 2 if false else 3", 3),
    ("1 + 1 if true else 0", 2),
    ("0 if false else 1 + 1", 2),
    ("true or false if false else false", False),
    ("not false if false else false", False),
    ("[1, 2][1] + 1", 3),
    ("3 - 1 - 1 == 1", True),
])
def test_operators_follow_the_python_precedence_table(text: str, expected: object) -> None:
    assert ev(text) == expected
    assert type(ev(text)) is type(expected)


def test_unary_minus_binds_looser_than_indexing_and_tighter_than_multiplication() -> None:
    assert ev("-x[0] * 2", x=(3,)) == -6
    assert ev("-x[1]", x=(3, 4)) == -4


@pytest.mark.parametrize(("text", "expected"), [
    ("-7 // 2", -4), ("-7 % 2", 1), ("7 % -2", -1), ("7 // -2", -4), ("-7 % -2", -1),
    ("0 // 5", 0), ("6 // 3", 2),
])
def test_floor_division_and_modulo_follow_python_floor_semantics(text: str, expected: int) -> None:
    assert ev(text) == expected


def test_a_long_flat_chain_of_additions_is_not_too_deep() -> None:
    assert ev("1 + " * 240 + "1") == 241
    assert ev("true and " * 100 + "true") is True


def test_chained_comparisons_mean_the_conjunction_of_each_pair() -> None:
    assert ev("1 < 2 < 3") is True
    assert ev("1 < 3 < 2") is False
    assert ev("3 > 2 >= 2 > 1") is True
    assert ev("1 == 1 != 2") is True
    assert ev("0 <= unit < n", unit=2, n=3) is True
    assert ev("0 <= unit < n", unit=3, n=3) is False


def test_chained_comparisons_stop_at_the_first_false_pair() -> None:
    assert ev("1 > 2 > missing") is False
    assert "unknown name `missing`" in fails("1 < 2 < missing").message


def test_a_parenthesized_comparison_is_not_chained() -> None:
    error = fails("(1 < 2) < 3")
    assert error.message == "`<` needs two integers or two strings, found bool (true) and int (3)"
    assert error.offset == 8


def test_strings_compare_by_equality_and_order() -> None:
    assert ev("quant_method == 'fp8'", quant_method="fp8") is True
    assert ev("quant_method != \"fp8\"", quant_method="awq") is True
    assert ev("'a' < 'b'") is True


def test_anything_compares_with_null() -> None:
    assert ev("x == null", x=None) is True
    assert ev("x == null", x=3) is False
    assert ev("x != None", x="s") is True


def test_lists_compare_element_by_element_without_mixing_bool_and_int() -> None:
    assert ev("[1, 2] == [1, 2]") is True
    assert ev("[1, 2] == [1, 3]") is False
    assert ev("[1] == [true]") is False


def test_equality_between_different_types_is_a_type_error() -> None:
    error = fails("1 == true")
    assert error.message == "`==` compares values of the same type, found int (1) and bool (true)"
    assert error.offset == 2
    assert fails("n != 'a'", n=3).offset == 2


def test_ordering_needs_two_integers_or_two_strings() -> None:
    error = fails("'a' < 1")
    assert error.message == "`<` needs two integers or two strings, found str ('a') and int (1)"
    assert error.offset == 4


def test_conditional_evaluates_only_the_chosen_branch() -> None:
    assert ev("1 if true else 1 // 0") == 1
    assert ev("1 // 0 if false else 2") == 2
    text = "num_key_value_heads if num_key_value_heads != null else num_attention_heads"
    assert ev(text, num_key_value_heads=None, num_attention_heads=32) == 32
    assert ev(text, num_key_value_heads=8, num_attention_heads=32) == 8


def test_conditional_needs_a_bool_condition_and_suggests_comparing_with_null() -> None:
    text = "num_key_value_heads if num_key_value_heads else num_attention_heads"
    error = fails(text, num_key_value_heads=8, num_attention_heads=32)
    assert error.message.startswith(
        "the condition of `if` must be a bool, found int (8) for `num_key_value_heads`")
    assert "`num_key_value_heads != null`" in error.message
    assert error.offset == 23


def test_in_and_not_in_test_membership_of_lists_and_substrings() -> None:
    assert ev("unit not in mlp_only_layers", unit=3, mlp_only_layers=(1, 2)) is True
    assert ev("unit not in mlp_only_layers", unit=2, mlp_only_layers=(1, 2)) is False
    assert ev("unit in mlp_only_layers", unit=2, mlp_only_layers=[1, 2]) is True
    assert ev("'a' in 'cat'") is True
    assert ev("'dog' not in 'cat'") is True
    assert ev("true in [1]") is False
    assert ev("[1, 2] in [[1, 2]]") is True
    assert ev("null in [null]") is True


def test_in_needs_a_list_or_string_on_the_right() -> None:
    error = fails("1 in 5")
    assert error.message == "`in` needs a list or a string on the right, found int (5)"
    assert error.offset == 2
    error = fails("1 not in 'abc'")
    assert error.message == ("`not in` with a string on the right needs a string on the left, "
                             "found int (1)")
    assert error.offset == 2


def test_and_or_short_circuit() -> None:
    text = "unit >= first_k_dense_replace and (unit - first_k_dense_replace) % moe_layer_freq == 0"
    env = {"first_k_dense_replace": 3, "moe_layer_freq": 0}
    assert parse(text).evaluate({**env, "unit": 1}) is False
    assert ev("true or 1 // 0 == 0") is True


@pytest.mark.parametrize(("text", "message", "offset"), [
    ("1 and true", "`and` needs bools, found int (1) for `1`", 0),
    ("false or 2", "`or` needs bools, found int (2) for `2`", 9),
    ("not 1", "`not` needs a bool, found int (1)", 0),
    ("-true", "unary `-` needs an integer, found bool (true)", 0),
    ("true + 3", "`+` needs integers, found bool (true) and int (3)", 5),
    ("'a' + 'b'", "`+` needs integers, found str ('a') and str ('b')", 4),
    ("[1] - [2]", "`-` needs integers, found list ([1]) and list ([2])", 4),
    ("[1] * true", "`*` needs integers, found list ([1]) and bool (true)", 4),
    ("[1] + 2", "`+` needs integers, found list ([1]) and int (2)", 4),
    ("null - 1", "`-` needs integers, found null and int (1)", 5),
])
def test_operators_reject_operands_of_the_wrong_type(text: str, message: str, offset: int) -> None:
    error = fails(text)
    assert (error.message, error.offset, error.expression) == (message, offset, text)


def test_a_list_times_an_integer_repeats_it_and_plus_concatenates_lists() -> None:
    assert ev("[ffn, ffn] * experts", ffn=8, experts=3) == (8,) * 6
    assert ev("experts * [ffn]", ffn=8, experts=2) == (8, 8)
    assert ev("[q] + [kv] * 2 + []", q=64, kv=16) == (64, 16, 16)
    assert ev("[1] * 0") == ()
    assert ev("len([1, 2] * 3) == 6") is True


@pytest.mark.parametrize(("text", "message", "offset"), [
    ("[1] * -1", "a list can be repeated 0 or more times, found -1 in `[1] * -1`", 4),
    ("[1, 2] * 40000", "`[1, 2] * 40000` would build a list of 80000 elements (nested lists "
                       "counted whole); partc accepts at most 65536", 7),
    ("[1] * 65536 + [2]", "`[1] * 65536 + [2]` would build a list of 65537 elements", 12),
    ("[[0] * 65536] * 2", "`[[0] * 65536] * 2` would build a list of 131074 elements", 14),
])
def test_list_repetition_is_bounded_so_a_family_cannot_exhaust_memory(
        text: str, message: str, offset: int) -> None:
    error = fails(text)
    assert error.message.startswith(message) and error.offset == offset, error.message


# ---------------------------------------------------------------- indexing and functions


def test_indexing_reads_list_and_string_elements_with_negative_indices() -> None:
    assert ev("weight_block_size[1]", weight_block_size=(128, 64)) == 64
    assert ev("x[-1]", x=(1, 2, 3)) == 3
    assert ev("'abc'[1]") == "b"
    assert ev("[[1, 2], [3]][0][1]") == 2
    assert ev("x[n - 1]", x=(5, 6), n=2) == 6


@pytest.mark.parametrize(("text", "message", "offset"), [
    ("x[2]", "index 2 is out of range for `x` of length 2", 1),
    ("x[-3]", "index -3 is out of range for `x` of length 2", 1),
    ("x[true]", "an index must be an integer, found bool (true)", 2),
    ("n[0]", "indexing needs a list or a string, found int (5) for `n`", 1),
])
def test_bad_indexing_is_an_error_at_the_bracket(text: str, message: str, offset: int) -> None:
    error = fails(text, x=(1, 2), n=5)
    assert (error.message, error.offset) == (message, offset)


@pytest.mark.parametrize(("text", "expected"), [
    ("min(3, 1, 2)", 1), ("max(3, 1, 2)", 3), ("min(7)", 7), ("min([4, 5])", 4),
    ("max(x)", 9), ("gcd(12, 18)", 6), ("gcd(x)", 1), ("gcd(0, 0)", 0), ("gcd(-4, 6)", 2),
    ("ceil_div(10, 3)", 4), ("ceil_div(9, 3)", 3), ("ceil_div(-7, 2)", -3),
    ("ceil_div(intermediate_size, weight_block_size[1])", 144),
    ("len([1, 2, 3])", 3), ("len('abc')", 3), ("len(x)", 3), ("len([])", 0),
    ("abs(-5)", 5), ("abs(5)", 5), ("min(1, 2,)", 1),
])
def test_each_builtin_function_computes_its_value(text: str, expected: int) -> None:
    env: dict[str, Any] = {"x": (4, 9, 6), "intermediate_size": 18432,
                           "weight_block_size": (128, 128)}
    assert parse(text).evaluate(env) == expected


@pytest.mark.parametrize(("text", "message", "offset"), [
    ("ceil_div(1, 0)", "`ceil_div` needs a positive divisor, found 0 for `0`", 12),
    ("ceil_div(1, b)", "`ceil_div` needs a positive divisor, found -2 for `b`", 12),
    ("len(5)", "`len` needs a list or a string, found int (5) for `5`", 4),
    ("min(true, 1)", "`min` needs integers, found bool (true) for `true`", 4),
    ("max([])", "`max` of an empty list `[]`", 4),
    ("min([1, 'a'])", "`min` needs integers, found str ('a') for `[1, 'a']`", 4),
    ("abs('a')", "`abs` needs integers, found str ('a') for `'a'`", 4),
    ("gcd(1, null)", "`gcd` needs integers, found null for `null`", 7),
])
def test_functions_reject_bad_arguments(text: str, message: str, offset: int) -> None:
    error = fails(text, b=-2)
    assert (error.message, error.offset) == (message, offset)


@pytest.mark.parametrize(("text", "message"), [
    ("ceil_div(1)", "`ceil_div` takes 2 arguments, found 1"),
    ("len(1, 2)", "`len` takes 1 argument, found 2"),
    ("min()", "`min` takes at least 1, found 0"),
])
def test_function_arity_is_checked_when_parsing(text: str, message: str) -> None:
    with pytest.raises(ExpressionError) as info:
        parse(text)
    assert (info.value.message, info.value.offset) == (message, 0)


def test_unknown_function_is_a_parse_error_with_a_suggestion() -> None:
    with pytest.raises(ExpressionError) as info:
        parse("1 + ceil_dv(a, b)")
    assert info.value.message == ("unknown function `ceil_dv`; did you mean `ceil_div`? "
                                  "(known: abs, ceil, ceil_div, floor, gcd, len, max, min, round)")
    assert info.value.offset == 4


# ---------------------------------------------------------------- names and environment


def test_names_lists_every_free_name_but_not_functions() -> None:
    text = "unit >= first_k_dense_replace and (unit - first_k_dense_replace) % moe_layer_freq == 0"
    assert parse(text).names == {"unit", "first_k_dense_replace", "moe_layer_freq"}
    assert parse("ceil_div(a, b[1])").names == {"a", "b"}
    assert parse("x if true else y").names == {"x", "y"}
    assert parse("1 + 2").names == frozenset()
    assert parse("1 + 2").is_constant and not parse("x").is_constant


def test_unknown_name_suggests_a_close_match_and_lists_known_names() -> None:
    error = fails("hiden_size // 2", hidden_size=4096, num_heads=32)
    assert error.message == ("unknown name `hiden_size`; did you mean `hidden_size`? "
                             "(known: hidden_size, num_heads)")
    assert error.offset == 0
    assert fails("2 * foo").message == "unknown name `foo` (no names are defined here)"
    many = {f"name{i:02d}": i for i in range(12)}
    message = fails("zzz", **many).message
    assert message.endswith("(known: name00, name01, name02, name03, name04, name05, name06, "
                            "name07, name08, name09, ... (2 more))")


def test_environment_lists_are_read_as_tuples() -> None:
    assert ev("layers", layers=[1, [2, 3]]) == (1, (2, 3))
    assert ev("len(layers)", layers=[1, 2, 3]) == 3


def test_an_environment_value_of_an_unsupported_type_is_an_error_at_the_name() -> None:
    error = fails("1 + rope", rope={"type": "yarn"})
    assert error.message == ("`rope` is a dict ({'type': 'yarn'}); expressions handle only "
                             "integers, floats, bools, strings, null and lists")
    assert error.offset == 4


def test_an_unused_environment_value_of_an_unsupported_type_is_ignored() -> None:
    assert ev("n + 1", n=1, rms_norm_eps=1e-06, rope={"type": "yarn"}) == 2


def test_evaluate_int_and_evaluate_bool_check_the_result_type() -> None:
    assert parse("6 // 2").evaluate_int({}) == 3
    assert parse("1 < 2").evaluate_bool({}) is True
    with pytest.raises(ExpressionError) as info:
        parse("true").evaluate_int({})
    assert (info.value.message, info.value.offset) == ("expected an integer, found bool (true)", 0)
    with pytest.raises(ExpressionError) as info:
        parse(" 1").evaluate_bool({})
    assert (info.value.message, info.value.offset) == ("expected a bool, found int (1)", 1)


def test_a_string_result_longer_than_the_limit_is_an_error() -> None:
    assert ev("len(s)", s="x" * 1001) == 1001
    assert "string result is 1001 characters long" in fails("s", s="x" * 1001).message


def test_examples_from_family_files_evaluate() -> None:
    env: dict[str, Any] = {
        "hidden_size": 7168, "num_attention_heads": 128, "head_dim": 56, "unit": 5,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "mlp_only_layers": (),
        "quant_method": "fp8", "intermediate_size": 18432, "weight_block_size": [128, 128],
        "num_key_value_heads": None, "num_hidden_layers": 61}
    assert parse("hidden_size // num_attention_heads").evaluate(env) == 56
    assert parse("num_attention_heads * head_dim").evaluate(env) == 7168
    assert parse("unit >= first_k_dense_replace and (unit - first_k_dense_replace) "
                 "% moe_layer_freq == 0").evaluate(env) is True
    assert parse("unit not in mlp_only_layers").evaluate(env) is True
    assert parse("quant_method == 'fp8'").evaluate(env) is True
    assert parse("ceil_div(intermediate_size, weight_block_size[1])").evaluate(env) == 144


# ---------------------------------------------------------------- arithmetic errors


def test_floor_division_by_zero_names_the_operator() -> None:
    error = fails("hidden_size // num_heads", hidden_size=4096, num_heads=0)
    assert error.message == "division by zero: `hidden_size // num_heads` where num_heads = 0"
    assert error.offset == 12
    assert error.expression == "hidden_size // num_heads"


def test_modulo_by_zero_names_the_operator() -> None:
    error = fails("7 % 0")
    assert (error.message, error.offset) == ("modulo by zero: `7 % 0`", 2)
    error = fails("10 - 4 % (2 - 2)")
    assert (error.message, error.offset) == ("modulo by zero: `4 % (2 - 2)` where (2 - 2) = 0", 7)


@pytest.mark.parametrize(("text", "x", "offset"), [
    ("9223372036854775807 + 1", 0, 20),
    ("-9223372036854775807 - 1", 0, 21),
    ("x * x", 2**32, 2),
    ("1 + x * x * x", 2**21, 10),
    ("-x - x", 2**62, 3),
])
def test_integer_overflow_is_an_error_at_the_operator(text: str, x: int, offset: int) -> None:
    error = fails(text, x=x)
    assert error.message.startswith("integer overflow: `")
    assert error.message.endswith("exceeds 2**63")
    assert error.offset == offset


def test_integers_up_to_the_bound_are_allowed() -> None:
    assert ev("9223372036854775807") == INT_BOUND - 1
    assert ev("-9223372036854775807 - 0") == -(INT_BOUND - 1)


def test_an_integer_literal_or_value_beyond_the_bound_is_an_overflow() -> None:
    with pytest.raises(ExpressionError) as info:
        parse("1 + 9223372036854775808")
    assert info.value.message == "integer overflow: `9223372036854775808` exceeds 2**63"
    assert info.value.offset == 4
    error = fails("n + 1", n=2**63)
    assert error.message == "integer overflow: `n` = 9223372036854775808 exceeds 2**63"
    assert error.offset == 0


# ---------------------------------------------------------------- syntax errors


@pytest.mark.parametrize(("text", "message", "offset"), [
    ("2 + 1.5", "floating-point literal `1.5` is not supported: only integers", 4),
    (".5", "floating-point literal `.5` is not supported: only integers", 0),
    ("1.", "floating-point literal `1.` is not supported: only integers", 0),
    ("0x10", "hexadecimal literal `0x10` is not supported: write a decimal integer", 0),
    ("0o7", "octal literal `0o7` is not supported: write a decimal integer", 0),
    ("0b1", "binary literal `0b1` is not supported: write a decimal integer", 0),
    ("1e3", "exponent literal `1e3` is not supported: write the integer in full", 0),
    ("x * 1e-3", "exponent literal `1e-3` is not supported: write the integer in full", 4),
    ("1_000", "digit separators are not allowed in `1_000`: write `1000`", 0),
    ("007", "leading zeros are not allowed in `007`: write `7`", 0),
    ("12abc", "invalid number `12abc`", 0),
    ("a / b", "`/` is not supported: use `//` for integer (floor) division", 2),
    ("2 ** 3", "`**` (power) is not supported", 2),
    ("a = 1", "`=` is not an operator: use `==` to compare", 2),
    ("!a", "`!` is not an operator: use `not`", 0),
    ("a && b", "`&&` is not an operator: use `and`", 2),
    ("a || b", "`||` is not an operator: use `or`", 2),
    ("a.b", "attribute access with `.` is not supported", 1),
    ("x[1:2]", "`:` is not supported (no slices, no format specifications)", 3),
    ("a @ b", "unexpected character '@'", 2),
    ("\u0663", "unexpected character '\u0663'", 0),
    ("'a\\qb'", "unsupported escape `\\q` in a string (allowed: \\\\ \\' \\\" \\n \\t)", 2),
    ("'abc", "unterminated string: missing closing `'`", 0),
    ("x == \"abc", "unterminated string: missing closing `\"`", 5),
    ("'a\nb'", "unterminated string: missing closing `'`", 0),
    ("'abc\\", "unterminated string: missing closing `'`", 0),
    ("1 2", "unexpected integer 2 after a complete expression", 2),
    ("a b", "unexpected name `b` after a complete expression", 2),
    ("1)", "unmatched `)`", 1),
    ("(1 + 2", "expected `)` to close the `(` at offset 0, found the end of the expression", 6),
    ("[1, 2", "expected `,` or `]` in the `[` at offset 0, found the end of the expression", 5),
    ("1 +", "expected a value, found the end of the expression", 3),
    ("* 2", "expected a value, found `*`", 0),
    ("+2", "expected a value, found `+`", 0),
    ("1 if true", "expected `else` after the condition of the `if` at offset 2, found the end "
                  "of the expression", 9),
    ("1 if true else", "expected a value, found the end of the expression", 14),
    ("(1, 2)", "tuples in parentheses are not supported: write a list `[a, b]`", 2),
    ("1 == not true", "`not` cannot appear here without parentheses: write `(not ...)`", 5),
    ("min(a=1)", "`=` is not an operator: use `==` to compare", 5),
    ("", "empty expression", 0),
    ("   ", "empty expression", 0),
])
def test_syntax_errors_point_at_the_offending_token(text: str, message: str, offset: int) -> None:
    with pytest.raises(ExpressionError) as info:
        parse(text)
    assert (info.value.message, info.value.offset, info.value.expression) == (message, offset, text)


def test_supported_string_escapes_are_decoded() -> None:
    assert ev("'a\\\\b\\'c\\\"d\\ne\\tf'") == "a\\b'c\"d\ne\tf"
    assert ev('"it\'s"') == "it's"


def test_keywords_spell_booleans_and_null_in_both_cases() -> None:
    assert [ev(t) for t in ("true", "True", "false", "False", "null", "None")] == [
        True, True, False, False, None, None]


def test_an_expression_longer_than_the_limit_is_an_error() -> None:
    assert ev("1+" * 499 + "1 ") == 500
    text = "1 + " * 250 + "1"
    with pytest.raises(ExpressionError) as info:
        parse(text)
    assert info.value.message == "expression is 1001 characters long; the limit is 1000"
    assert info.value.offset == MAX_TEXT_LENGTH


def test_nesting_up_to_the_limit_parses_and_one_more_level_is_an_error() -> None:
    assert ev("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) == 1
    assert ev("-" * MAX_DEPTH + "1") == 1
    for text, offset in [("(" * 65 + "1" + ")" * 65, 64), ("-" * 65 + "1", 64),
                         ("not " * 65 + "true", 256), ("[" * 65 + "1" + "]" * 65, 64),
                         ("x" + "[0]" * 65, 193), ("abs(" * 65 + "1" + ")" * 65, 259)]:
        with pytest.raises(ExpressionError) as info:
            parse(text)
        assert info.value.message == "expression nests deeper than 64 levels"
        assert info.value.offset == offset


def test_ten_thousand_nested_parentheses_are_an_expression_error() -> None:
    text = "(" * 10_000 + "1" + ")" * 10_000
    with pytest.raises(ExpressionError):
        parse(text)


def test_depth_is_bounded_even_when_the_length_limit_is_lifted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expr_module, "MAX_TEXT_LENGTH", 10**6)
    for text in ["(" * 10_000 + "2" + ")" * 10_000, "-" * 10_000 + "2", "not " * 10_000 + "x",
                 "x[" * 10_000 + "0" + "]" * 10_000, "min(" * 10_000 + "2" + ")" * 10_000]:
        with pytest.raises(ExpressionError) as info:
            parse(text)
        assert info.value.message == "expression nests deeper than 64 levels"


def test_a_list_literal_longer_than_the_limit_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expr_parse, "MAX_TUPLE_LENGTH", 3)
    assert ev("[5, 6, 7]") == (5, 6, 7)
    with pytest.raises(ExpressionError) as info:
        parse("[5, 6, 7, 8]")
    assert info.value.message == "more than 3 elements in the `[` at offset 0"
    assert info.value.offset == 10


def test_attribute_access_and_calls_of_host_functions_are_rejected_without_running_anything(
) -> None:
    calls: list[object] = []

    def spy(*args: object) -> int:
        calls.append(args)
        return 0

    for text, message, offset in [
        ("__import__('os')", "unknown function `__import__`", 0),
        ("open('/etc/passwd')", "unknown function `open`", 0),
        ("eval('1')", "unknown function `eval`", 0),
        ("exec('1')", "unknown function `exec`", 0),
        ("f(1)", "unknown function `f`", 0),
        ("x.__class__", "attribute access with `.` is not supported", 1),
        ("().__class__", "expected a value, found `)`", 1),
        ("(f)(1)", "unexpected `(` after a complete expression", 3),
        ("lambda: 1", "`:` is not supported (no slices, no format specifications)", 6),
    ]:
        with pytest.raises(ExpressionError) as info:
            parse(text).evaluate({"f": spy, "x": 1})  # type: ignore[dict-item]
        assert info.value.message.startswith(message)
        assert info.value.offset == offset
    error = fails("f", f=spy)
    assert error.message.startswith("`f` is a function (")
    assert calls == []


# ---------------------------------------------------------------- constants and spelling


@pytest.mark.parametrize(("value", "text"), [
    (None, "null"), (True, "true"), (False, "false"), (3, "3"), (-3, "-3"), ("x", "'x'"),
    ("it's", "'it\\'s'"), ("a\\b\n\t", "'a\\\\b\\n\\t'"), ((1, (2, "a")), "[1, [2, 'a']]"),
    ((), "[]"),
])
def test_format_value_spells_values_canonically(value: Any, text: str) -> None:
    assert format_value(value) == text


@pytest.mark.parametrize("value", [4096, -3, 0, True, False, "fp8", None, (1, 2), ("a", (3,))])
def test_constant_has_the_canonical_text_and_yields_its_value(value: Any) -> None:
    expression = constant(value)
    assert expression.text == format_value(value)
    assert expression.names == frozenset()
    assert expression.evaluate({}) == value
    assert parse(expression.text).evaluate({}) == value


@pytest.mark.parametrize(("value", "message"), [
    (1.5, "the constant is a float (1.5)"),
    (2**63, "integer overflow: the constant = 9223372036854775808 exceeds 2**63"),
    ("x" * 1001, "string constant is 1001 characters long; the limit is 1000"),
])
def test_constant_rejects_values_outside_the_language(value: Any, message: str) -> None:
    with pytest.raises(ExpressionError) as info:
        constant(value)
    assert info.value.message.startswith(message)


def test_constant_int_type_checks() -> None:
    assert constant(7).evaluate_int({}) == 7
    with pytest.raises(ExpressionError, match="expected an integer, found bool"):
        constant(True).evaluate_int({})


# ---------------------------------------------------------------- templates


def test_template_fields_render_integers_and_strings() -> None:
    template = parse_template("model.layers.{unit}.mlp.experts.{expert}.gate_proj")
    assert template.render({"unit": 3, "expert": 7}) == "model.layers.3.mlp.experts.7.gate_proj"
    assert template.names == {"unit", "expert"}
    assert not template.is_constant
    assert [f.offset for f in template.fields] == [14, 33]
    assert parse_template("model.layers.{num_hidden_layers + unit}").render(
        {"num_hidden_layers": 61, "unit": 2}) == "model.layers.63"
    assert parse_template("{prefix}.weight").render({"prefix": "model"}) == "model.weight"


def test_template_double_braces_are_literal_braces() -> None:
    template = parse_template("{{unit}}")
    assert template.render({}) == "{unit}"
    assert template.is_constant and template.names == frozenset()
    assert parse_template("a{{b}}c{x}").render({"x": 5}) == "a{b}c5"
    assert parse_template("").render({}) == ""


def test_template_fields_may_hold_braces_inside_strings() -> None:
    assert parse_template("{'}'}").render({}) == "}"
    assert parse_template("<{'{'}>").render({}) == "<{>"


def test_template_parse_errors_inside_fields_have_offsets_in_the_whole_template() -> None:
    with pytest.raises(ExpressionError) as info:
        parse_template("model.layers.{unit +}.x")
    assert info.value.message == "expected a value, found the end of the expression"
    assert info.value.offset == 20
    assert info.value.expression == "model.layers.{unit +}.x"
    with pytest.raises(ExpressionError) as info:
        parse_template("x{1 / 2}")
    assert info.value.offset == 4


def test_template_evaluation_errors_have_offsets_in_the_whole_template() -> None:
    error = template_fails("a.{x // y}", x=1, y=0)
    assert (error.message, error.offset) == ("division by zero: `x // y` where y = 0", 5)
    error = template_fails("layers.{unti}", unit=1)
    assert error.message.startswith("unknown name `unti`; did you mean `unit`?")
    assert error.offset == 8


@pytest.mark.parametrize(("value", "found"), [
    (True, "bool (true)"), (None, "null"), ((1, 2), "list ([1, 2])"),
])
def test_template_fields_must_be_integers_or_strings(value: object, found: str) -> None:
    error = template_fails("w.{flag}", flag=value)
    assert error.message == ("template field `{flag}` must be an integer or a string, found "
                             + found)
    assert error.offset == 3


@pytest.mark.parametrize(("text", "message", "offset"), [
    ("a.{x", "unclosed `{` in template: close the field with `}` or write `{{` for a literal "
             "brace", 2),
    ("a}b", "single `}` in template: write `}}` for a literal brace", 1),
    ("a.{}", "empty template field `{}`: write `{{}}` for literal braces", 2),
    ("{ }", "empty template field `{}`: write `{{}}` for literal braces", 0),
    ("{a{b}}", "`{` inside a template field: fields cannot nest", 2),
    ("x{'abc}", "unterminated string in the template field at offset 1", 2),
    ("x" * 1001, "template is 1001 characters long; the limit is 1000", 1000),
])
def test_unbalanced_template_braces_are_errors(text: str, message: str, offset: int) -> None:
    with pytest.raises(ExpressionError) as info:
        parse_template(text)
    assert (info.value.message, info.value.offset, info.value.expression) == (message, offset, text)


def test_a_rendered_template_longer_than_the_limit_is_an_error() -> None:
    error = template_fails("{s}{s}", s="x" * 600)
    assert error.message == "rendered template is 1200 characters long; the limit is 1000"


# ---------------------------------------------------------------- properties

_LEVEL = {"+": 1, "-": 1, "*": 2, "//": 2, "%": 2}
_leaves = st.integers(-3, 3) | st.integers(-(10**6), 10**6)
_trees = st.recursive(
    _leaves,
    lambda kids: st.tuples(st.sampled_from(sorted(_LEVEL)), kids, kids, st.booleans()),
    max_leaves=16,
)


def _render(tree: Any) -> tuple[str, int]:
    """Spell a tree with the fewest parentheses (plus optional redundant ones); return its level."""
    if isinstance(tree, int):
        return str(tree), 3
    op, left, right, wrap = tree
    level = _LEVEL[op]
    left_text, left_level = _render(left)
    right_text, right_level = _render(right)
    if left_level < level:
        left_text = f"({left_text})"
    if right_level <= level:
        right_text = f"({right_text})"
    text = f"{left_text} {op} {right_text}"
    return (f"({text})", 3) if wrap else (text, level)


def _compute(tree: Any) -> int:
    """Python's own value of a tree; ZeroDivisionError or OverflowError like the language."""
    if isinstance(tree, int):
        return tree
    op, left, right, _ = tree
    a, b = _compute(left), _compute(right)
    if op == "+":
        result = a + b
    elif op == "-":
        result = a - b
    elif op == "*":
        result = a * b
    elif op == "//":
        result = a // b
    else:
        result = a % b
    if abs(result) >= 2**63:
        raise OverflowError(op)
    return result


@given(_trees)
@settings(max_examples=400)
def test_integer_arithmetic_agrees_with_python(tree: Any) -> None:
    text, _ = _render(tree)
    expression = parse(text)
    try:
        expected = _compute(tree)
    except ZeroDivisionError:
        with pytest.raises(ExpressionError, match="by zero"):
            expression.evaluate({})
        return
    except OverflowError:
        with pytest.raises(ExpressionError, match="integer overflow"):
            expression.evaluate({})
        return
    assert expression.evaluate({}) == expected


def _parse_and_evaluate(text: str) -> None:
    """Parse and evaluate `text`, allowing only ExpressionError to escape."""
    try:
        parse(text).evaluate({"x": 3, "y": (1, 2), "s": "ab", "n": None})
    except ExpressionError as error:
        assert 0 <= error.offset <= len(text)


@given(st.text())
def test_arbitrary_text_parses_or_raises_expression_error(text: str) -> None:
    _parse_and_evaluate(text)


_FRAGMENTS = ["(", ")", "[", "]", "+", "-", "*", "//", "%", "==", "<", ">=", "!=", " in ", "not ",
              " and ", " or ", " if ", " else ", "true", "null", "0", "1", "7", "x", "y", "s", "n",
              "'s'", ",", " ", "min(", "ceil_div(", "len(", "gcd(", "abs(", "\\", "'", ".", "/"]


@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map("".join))
@settings(max_examples=500)
def test_token_soup_parses_or_raises_expression_error(text: str) -> None:
    _parse_and_evaluate(text)


@given(st.text())
def test_arbitrary_template_text_parses_or_raises_expression_error(text: str) -> None:
    try:
        parse_template(text).render({"x": 1})
    except ExpressionError as error:
        assert 0 <= error.offset <= len(text)


@given(st.text(max_size=200))
def test_constant_strings_round_trip_through_their_canonical_text(value: str) -> None:
    assert parse(constant(value).text).evaluate({}) == value
