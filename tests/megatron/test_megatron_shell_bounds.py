"""The script interpreter's arithmetic and expansion are bounded: 64-bit results as bash's, nesting and sizes
limited, every adversarial input a `path: line N: message` error from `import-megatron`, never a traceback."""

from __future__ import annotations

import textwrap

import pytest

from heteroflow.cli import main
from heteroflow.megatron.shell import ShellSyntaxError, run_script
from heteroflow.megatron.shell.arith import MAX_CHARS, MAX_DEPTH, ArithError, evaluate
from heteroflow.megatron.shell.expand import MAX_WORD_CHARS


def value(expr: str) -> int | None:
    return evaluate(expr, lambda name: None)


@pytest.mark.parametrize("expr, want", [
    ("2**63", -2**63), ("2**64", 0), ("9223372036854775807 + 1", -2**63), ("-9223372036854775808 - 1", 2**63 - 1),
    ("3**40", 3**40 % 2**64 - 2**64 if 3**40 % 2**64 >= 2**63 else 3**40 % 2**64), ("1 << 64", 1), ("1 << 63", -2**63),
    ("-1 >> 70", -1), ("18446744073709551616", 0), ("0x10", 16), ("010", 8), ("2#101", 5), ("16#ff", 255),
    ("36#Z", 35), ("64#_", 63), ("64#@", 62), ("64#Z", 61), ("-7 / 2", -3), ("-7 % 2", -1),
])
def test_results_are_64_bit_as_in_bash(expr, want):
    assert value(expr) == want


def test_huge_exponents_and_shifts_finish_at_once():
    assert value("7 ** 99999999999999") == pow(7, 99999999999999, 2**64) - (2**64 if pow(7, 99999999999999, 2**64)
                                                                             >= 2**63 else 0)
    assert value("2 ** 2 ** 2 ** 2 ** 2") == 0  # 2**65536: its low 64 bits
    assert value("1 << 100000000000") == 1 << (100000000000 & 63)


@pytest.mark.parametrize("expr, message", [
    ("(" * (MAX_DEPTH + 5) + "1" + ")" * (MAX_DEPTH + 5), f"nests deeper than {MAX_DEPTH} levels"),
    ("- " * (MAX_DEPTH + 5) + "1", f"nests deeper than {MAX_DEPTH} levels"),
    ("! " * (MAX_DEPTH + 5) + "1", f"nests deeper than {MAX_DEPTH} levels"),
    ("2**" * (MAX_DEPTH + 5) + "1", f"nests deeper than {MAX_DEPTH} levels"),
    ("x=" * (MAX_DEPTH + 5) + "1", f"nests deeper than {MAX_DEPTH} levels"),
    ("1+" * (MAX_CHARS // 2) + "1", f"at most {MAX_CHARS:,} are read"),
    ("2 ** -1", "exponent less than 0"), ("65#1", "invalid arithmetic base 65"), ("1#1", "invalid arithmetic base 1"),
    ("09", "value too great for base 8"), ("2#102", "value too great for base 2"), ("1 / 0", "division by 0"),
], ids=["parentheses", "unary-minus", "not", "power-chain", "assignment-chain", "length", "negative-exponent",
        "base-65", "base-1", "octal", "binary", "division"])
def test_adversarial_expressions_are_arith_errors(expr, message):
    with pytest.raises(ArithError, match=message.replace("*", r"\*")):
        value(expr)


def test_one_deep_but_bounded_expression_still_evaluates():
    depth = MAX_DEPTH // 2 - 2
    assert value("(" * depth + "2" + ")" * depth) == 2


@pytest.mark.parametrize("script, message", [
    ("A=B\nB=A\necho $(( A + 1 ))", "line 3: variables refer to each other in arithmetic more than"),
    ("X=x\nfor i in " + " ".join(["1"] * 20) + "; do X=$X$X; done\necho $X",
     f"grows to 262,144 characters; at most {MAX_WORD_CHARS:,} are kept"),
    ("echo " + "$(" * 3000 + "1" + ")" * 3000, "the script nests too deeply to read"),
    ("echo $(( 1 / 0 ))", "line 1: division by 0 in arithmetic"),
], ids=["variable-loop", "doubling", "substitutions", "division"])
def test_adversarial_scripts_are_shell_errors_with_their_line(script, message):
    with pytest.raises(ShellSyntaxError, match=message.replace("(", r"\(").replace("$", r"\$")):
        run_script(textwrap.dedent(script))


@pytest.mark.parametrize("line", [
    "X=$(( " + "(" * 5000 + "1" + ")" * 5000 + " ))",
    "X=$(( " + "- " * 3000 + "1 ))",
    "X=$(( 99#1 ))",
    "A=B; B=A; X=$(( A ))",
    "X=" + "$(" * 3000 + "1" + ")" * 3000,
], ids=["parentheses", "unary-minus", "base", "variable-loop", "substitutions"])
def test_import_megatron_never_prints_a_traceback(tmp_path, capsys, line):
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/bash\n{line}\ntorchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 4 "
                      "--hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
                      "--micro-batch-size 2 --global-batch-size 16 --train-iters 10 --lr 1e-4 --vocab-size 512 "
                      "--seed $X\n")
    assert main(["import-megatron", str(script), "--device-type", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"heteroflow import-megatron: error: {script}: line 2: "), err[:500]
    assert "Traceback" not in err


def test_numbers_in_builtins_and_tests_are_bounded():
    assert words("set -- a b c\nshift " + "0" * 4999 + "1\necho $@") == ["b", "c"]  # no int() digit limit
    assert words("if [ 0010 -eq 10 ]; then echo equal; fi") == ["equal"]
    assert words("set -- a b\nshift \u00b2\necho $@") == ["b"]  # not an ASCII number: shift 1, as before
    with pytest.raises(ShellSyntaxError, match="a number of 20,000 digits"):
        run_script("shift " + "1" * 20_000 + "\n")


def words(script: str) -> list[str]:
    run = run_script(textwrap.dedent(script))
    return [f.text for f in run.commands[-1].fields[1:]]
