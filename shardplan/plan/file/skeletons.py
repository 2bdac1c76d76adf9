"""The grammar of a write skeleton (docs/plan-format.md, "Write skeletons"), checked recursively with a depth limit:
each tag with its exact arity, hole markers where integers were, op names collected for the allowlist check, `["a", i]`
pointing at an existing input. A mixin of plancheck.Checker, which provides the scalar checks and the errors."""

from __future__ import annotations

import re

from shardplan.plan.file.errors import advice
from shardplan.plan.ir import FRESH_OPS, INPLACE_OPS, UNARY_OPS
from shardplan.plan.template import HOLE

MAX_DEPTH = 24  # nesting of a write skeleton (legit plans: 4)
MAX_NDIM = 16  # dims of a tensor shape or region; also inputs, args and kwargs of a Call
MAX_CONST_NUMEL = 1 << 16
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")


class SkeletonRules:
    def skeleton(self, s, where: str) -> tuple[int, set[str]]:
        """A write skeleton; returns (number of holes, op names)."""
        ops: set[str] = set()
        self.array(s, where, 4)
        self.tag(s, where, "W")
        self.array(s[1], f"{where}.param", 2)
        self.tag(s[1], f"{where}.param", "n")
        holes = self.template(s[1][1], f"{where}.param.name")
        holes += self.region(s[2], f"{where}.dst")
        holes += self.view(s[3], f"{where}.src", 1, ops)
        return holes, ops

    def tag(self, s, where: str, *tags: str) -> str:
        if not s or s[0] not in tags:
            self.fail(where, s[:1] if s else s, f"must start with the tag {' or '.join(map(repr, tags))}")
        return s[0]

    def holes(self, t, where: str) -> int:
        self.array(t, where, max_len=MAX_NDIM)
        for i, h in enumerate(t):
            if h != HOLE or type(h) is not str:
                self.fail(f"{where}[{i}]", h, 'must be the hole marker "\\u0000#"')
        return len(t)

    def region(self, s, where: str) -> int:
        self.array(s, where, 4)
        self.tag(s, where, "r")
        if self.holes(s[1], f"{where}.offset") != 1:
            self.fail(f"{where}.offset", s[1], "must hold exactly one hole")
        ndim = self.holes(s[2], f"{where}.sizes")
        if self.holes(s[3], f"{where}.strides") != ndim:
            self.fail(f"{where}.strides", s[3], f"must have as many holes as sizes ({ndim})")
        return 1 + 2 * ndim

    def view(self, s, where: str, depth: int, ops: set[str]) -> int:
        self.depth(depth, where)
        self.array(s, where, 3)
        self.tag(s, where, "v")
        return self.leaf(s[1], f"{where}.leaf", depth + 1, ops) + self.region(s[2], f"{where}.region")

    def depth(self, depth: int, where: str) -> None:
        if depth > MAX_DEPTH:
            self.limit(where, f"nested deeper than {MAX_DEPTH} levels")

    def leaf(self, s, where: str, depth: int, ops: set[str]) -> int:
        self.depth(depth, where)
        self.array(s, where, min_len=1)
        tag = self.tag(s, where, "S", "F", "C", "U")
        if tag == "S":
            self.array(s, where, 2)
            return self.template(s[1], f"{where}.source")
        if tag == "F":
            self.array(s, where, 4)
            value = s[1]
            if type(value) is tuple:
                self.array(value, f"{where}.value", 2)
                self.tag(value, f"{where}.value", "f")
                if type(value[1]) is not float:
                    self.fail(f"{where}.value", value, 'a float fill value must be ["f", float]')
            elif type(value) is not bool:
                self.int_(value, f"{where}.value")
            self.dtype(s[3], f"{where}.dtype")
            return self.holes(s[2], f"{where}.sizes")
        if tag == "C":
            self.array(s, where, 6)
            op = self.str_(s[1], f"{where}.op")
            ops.add(op)
            inputs = self.array(s[4], f"{where}.inputs", max_len=MAX_NDIM)
            holes = sum(
                self.literal(a, f"{where}.args[{i}]", depth + 1, len(inputs))
                for i, a in enumerate(self.array(s[2], f"{where}.args", max_len=MAX_NDIM))
            )
            for i, kv in enumerate(self.array(s[3], f"{where}.kwargs", max_len=MAX_NDIM)):
                self.array(kv, f"{where}.kwargs[{i}]", 2)
                self.str_(kv[0], f"{where}.kwargs[{i}].key", pattern=_IDENT, rule="must be an identifier")
                holes += self.literal(kv[1], f"{where}.kwargs[{i}].value", depth + 1, len(inputs))
            holes += sum(self.view(v, f"{where}.inputs[{i}]", depth + 1, ops) for i, v in enumerate(inputs))
            if s[5] is not None:
                self.int_(s[5], f"{where}.out", 0, MAX_NDIM)
            if op in UNARY_OPS and (len(inputs) != 1 or s[2] != (("a", 0),) or s[3] or s[5] is not None):
                self.fail(
                    where, s[1:4], f'{op} takes exactly one tensor: args [["a", 0]], no kwargs, one input, out nil'
                )
            if any(kv[0] == "out" for kv in s[3]):
                self.foreign_write(where, f"{op} takes out=, which would write into the tensor it names")
            if op in INPLACE_OPS and not (s[2] and _is_arg(s[2][0]) and _made_by_plan(inputs[s[2][0][1]][1])):
                self.foreign_write(
                    where,
                    f"in-place {op} writes into its first argument, which must be a tensor the "
                    f"plan made (a Tensor.clone of the view, as the recorder writes it), never a "
                    f"trainer tensor or a view of one",
                )
            return holes
        self.array(s, where, 4)  # "U"
        return (
            self.leaf(s[1], f"{where}.base", depth + 1, ops)
            + self.region(s[2], f"{where}.region")
            + self.view(s[3], f"{where}.value", depth + 1, ops)
        )

    def foreign_write(self, where: str, why: str):
        raise self.op_error(
            f"{self.path}: {where}: {why}: replay never writes into the trainer's tensors; this plan "
            f"is corrupt or hostile. " + advice(self.path)
        )

    def literal(self, a, where: str, depth: int, num_inputs: int) -> int:
        """A literal of a Call; returns its number of holes."""
        self.depth(depth, where)
        if a is None or type(a) is bool:
            return 0
        if type(a) is str:
            if a == HOLE:
                return 1
            self.str_(a, where)
            return 0
        self.array(a, where, min_len=1)
        tag = self.tag(a, where, "f", "a", "d", "s", "k", "e", "t")
        if tag == "f":
            self.array(a, where, 2)
            if type(a[1]) is not float:
                self.fail(where, a, 'must be ["f", float]')
        elif tag == "a":
            self.array(a, where, 2)
            self.int_(a[1], f"{where}.index", 0, num_inputs - 1)
        elif tag == "d":
            self.array(a, where, 2)
            self.dtype(a[1], f"{where}.dtype")
        elif tag == "s":
            self.array(a, where, 4)
            for i, x in enumerate(a[1:]):
                if x is not None and (type(x) is not str or x != HOLE):
                    self.fail(f"{where}[{i + 1}]", x, "a slice bound must be nil or a hole")
            return sum(1 for x in a[1:] if x is not None)
        elif tag == "k":
            self.array(a, where, 4)
            self.dtype(a[1], f"{where}.dtype")
            numel = self.shape(a[2], f"{where}.shape")
            if numel > MAX_CONST_NUMEL:
                self.limit(f"{where}.shape", f"a constant of {numel} elements (at most {MAX_CONST_NUMEL})")
            self.array(a[3], f"{where}.values", numel)
            for i, x in enumerate(a[3]):
                if type(x) is int:
                    self.int_(x, f"{where}.values[{i}]")
                elif type(x) not in (float, bool):
                    self.fail(f"{where}.values[{i}]", x, "must be a number")
        elif tag == "e":
            self.array(a, where, 1)
        else:  # "t"
            return sum(self.literal(x, f"{where}[{i + 1}]", depth + 1, num_inputs) for i, x in enumerate(a[1:]))
        return 0


def _is_arg(a) -> bool:
    return type(a) is tuple and len(a) == 2 and a[0] == "a"


def _made_by_plan(s) -> bool:
    """ir.made_by_plan on an (already checked) skeleton leaf."""
    while True:
        if s[0] in ("F", "U"):
            return True
        if s[0] != "C" or s[5] is not None:
            return False
        if s[1] in FRESH_OPS:
            return True
        if s[1] not in INPLACE_OPS or not (s[2] and _is_arg(s[2][0])):
            return False
        s = s[4][s[2][0][1]][1]
