"""Megatron's `--moe-layer-freq`: an integer N or a Python list expression, read without running it.

Megatron evaluates the list form with Python (`"([0]*3+[1]*29)"`, `"[0,1,1]"`, `"([1]*3+[0]*2)*2"`);
here only list literals of integers, `+` between lists and `*` by an integer are accepted, so a script
cannot make the importer run code. heteroflow's `model.moe` describes the layer pattern as dense first
layers then every `layer_freq`-th layer (`MoESpec.is_moe_layer`); `dense_first_and_freq` finds those two
numbers for a pattern, when there are such.
"""

from __future__ import annotations

import ast

_MAX_LAYERS = 1 << 16


def _value(node: ast.AST) -> list[int] | int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_value(item) for item in node.elts]
        if not all(isinstance(v, int) for v in items):
            raise ValueError("list items must be integers")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(left, int) and isinstance(right, int):
                return left + right
            raise ValueError("`+` joins two lists")
        if isinstance(left, int) and isinstance(right, int):
            return left * right
        lst, times = (left, right) if isinstance(left, list) else (right, left)
        if not isinstance(lst, list) or not isinstance(times, int):
            raise ValueError("`*` repeats a list an integer number of times")
        if times < 0 or len(lst) * times > _MAX_LAYERS:
            raise ValueError(f"repeat count {times} is out of range")
        return lst * times
    raise ValueError(f"{ast.unparse(node)!r} is not a list of 0s and 1s")


def parse_layer_freq(value: object) -> int | list[int]:
    """Megatron's `moe_freq_type`: an int, or a list of 0/1 per layer from a list expression."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"invalid value {text!r}: an integer N (every N-th layer is MoE) or a Python list "
                             "expression of 0s and 1s") from None
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {text!r} as a Python list expression") from None
    pattern = _value(tree.body)
    if not isinstance(pattern, list):
        raise ValueError(f"{text!r} is not a list")
    if any(v not in (0, 1) for v in pattern):
        raise ValueError(f"{text!r}: entries must be 0 (dense layer) or 1 (MoE layer)")
    return pattern


def dense_first_and_freq(pattern: list[int]) -> tuple[int, int] | None:
    """(first_dense_layers, layer_freq) whose rule gives exactly `pattern` (layer i is MoE when
    i >= first_dense_layers and i % layer_freq == 0), or None when no pair does. Of the equivalent pairs
    the smallest frequency and then the fewest dense-first layers are chosen, so the answer does not
    depend on how the pattern was written."""
    if 1 not in pattern:
        return len(pattern), 1
    first = pattern.index(1)
    for freq in range(1, len(pattern) + 1):
        # The first MoE layer must itself satisfy i % freq == 0, and every later layer follow the rule.
        if first % freq == 0 and all(v == int(i >= first and i % freq == 0) for i, v in enumerate(pattern)):
            # Layers first-freq+1 .. first-1 are not multiples of freq: the dense prefix may stop there.
            return max(0, first - freq + 1), freq
    return None


def layer_freq_arg(num_layers: int, first_dense_layers: int, layer_freq: int) -> str:
    """`--moe-layer-freq` for heteroflow's rule: the integer when no layer is dense first, else the list
    expression Megatron evaluates (`([0]*3+[1]*29)`, or the explicit list)."""
    if first_dense_layers == 0:
        return str(layer_freq)
    first = min(first_dense_layers, num_layers)
    if layer_freq == 1:
        return f"([0]*{first}+[1]*{num_layers - first})" if first < num_layers else f"([0]*{num_layers})"
    pattern = [int(i >= first and i % layer_freq == 0) for i in range(num_layers)]
    return "[" + ",".join(map(str, pattern)) + "]"
