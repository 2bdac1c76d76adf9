"""The plan IR: what one consumer rank needs from the checkpoint, as a handful of immutable records.

Grammar (element units throughout; every tensor is addressed through a contiguous base of known shape):

    RankPlan := rank, params: TensorMeta*, writes: Write*, fallbacks: Fallback*, not_needed: name*
    Write    := param, dst: Region, src: View             # param.as_strided(dst).copy_(eval(src))
    View     := leaf: Leaf, region: Region                 # leaf.as_strided(region): never copies
    Region   := offset, sizes, strides
    Leaf     := Source(name)                               # a checkpoint tensor held by the trainer
              | Call(op, args, inputs: View*, out)         # an allowlisted op that materialises a tensor
              | Full(value, sizes, dtype)                  # a constant the loader wrote without reading
              | Update(base: Leaf, region, value: View)    # base with `region` overwritten (in-place op)
    Literal  := None | bool | int | float | str | Arg(i) | DType(name) | Const(dtype, shape, values)
              | tuple of Literal | Slice(start, stop, step) | Ellipsis

A pure view chain (narrow, view, transpose, unbind, chunk, expand, ...) folds into a single `View(Source, Region)`:
that is the common case and the only one a trainer replays with zero ops. Anything else stays as a `Call` whose
`op` must be in `ALLOWED_OPS`: a plan can name operations, never carry code.

`Write` ordering matters only where destinations overlap (last write wins, as in the real loader); the compiler keeps
recording order for those and sorts the rest.

This module imports nothing heavy (no torch, no vLLM): the trainer loads plans with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Union

# Out-of-place arithmetic a loader may apply to what it read (a scale, a sign): allowed, and always new storage.
ARITHMETIC_OPS: frozenset[str] = frozenset(
    {
        "Tensor.mul",
        "Tensor.add",
        "Tensor.sub",
        "Tensor.div",
        "Tensor.neg",
        "Tensor.__mul__",
        "Tensor.__add__",
        "Tensor.__sub__",
        "Tensor.__truediv__",
        "Tensor.__neg__",
    }
)
# Python-level ops a Call may name. Replay resolves them through this table only (see replay.resolve_op).
ALLOWED_OPS: frozenset[str] = frozenset(
    {
        "Tensor.reshape",
        "Tensor.view",
        "Tensor.contiguous",
        "Tensor.clone",
        "Tensor.flatten",
        "Tensor.__getitem__",
        "Tensor.index_select",
        "Tensor.repeat",
        "Tensor.repeat_interleave",
        "Tensor.to",
        "Tensor.float",
        "Tensor.half",
        "Tensor.bfloat16",
        "Tensor.type_as",
        "Tensor.narrow",
        "Tensor.transpose",
        "Tensor.t",
        "Tensor.permute",
        "Tensor.unsqueeze",
        "Tensor.squeeze",
        "Tensor.expand",
        "Tensor.chunk",
        "Tensor.split",
        "Tensor.unbind",
        "Tensor.view_as",
        "Tensor.reshape_as",
        "Tensor.zero_",
        "Tensor.fill_",
        "Tensor.mul_",
        "Tensor.add_",
        "Tensor.div_",
        "Tensor.sub_",
        "Tensor.copy_",
        "torch.cat",
        "torch.concat",
        "torch.stack",
        "torch.flatten",
        "torch.transpose",
        "torch.narrow",
        "torch.index_select",
        "torch.chunk",
        "torch.split",
        "torch.reshape",
        "torch.zeros_like",
        "torch.empty_like",
        "torch.exp",
        "Tensor.exp",
    }
    | ARITHMETIC_OPS
)
# Elementwise ops that take exactly one tensor (`["a", 0]`) and nothing else: the plan-file check refuses any other
# argument (an `out=` would write into a trainer tensor). `exp` is here for the Mamba family's A_log loaders, which
# write `-torch.exp(A_log.float())` (vLLM's mamba_mixer.A_weight_loader and mamba_mixer2's composed_weight_loader).
UNARY_OPS: frozenset[str] = frozenset({"torch.exp", "Tensor.exp"})


# In-place ops write into their first argument (`args[0]`, an `Arg`). Replay must never write into a trainer
# tensor, so a plan may apply one only to a tensor the plan itself made (`made_by_plan`): what the recorder writes for
# a loader that mutates its loaded tensor (`Tensor.clone` of the loaded view, then the op). Recorded plans hold no
# other form (none of the shipped plans has an in-place op at all); plan files and Replayer refuse any other, and the
# interpreter never runs one. No op may take an `out=` (it would write into whatever tensor it names).
INPLACE_OPS: frozenset[str] = frozenset(op for op in ALLOWED_OPS if op.endswith("_") and not op.endswith("__"))
# Ops whose result is always new storage, never a view of (or the same tensor as) an input.
FRESH_OPS: frozenset[str] = frozenset(
    {
        "Tensor.clone",
        "torch.cat",
        "torch.concat",
        "torch.stack",
        "Tensor.repeat",
        "Tensor.repeat_interleave",
        "Tensor.index_select",
        "torch.index_select",
        "torch.zeros_like",
        "torch.empty_like",
        "torch.exp",
        "Tensor.exp",
    }
    | ARITHMETIC_OPS
)


@dataclass(frozen=True, slots=True)
class Region:
    """as_strided geometry: storage offset, sizes and strides, in elements of the base tensor."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def extent(self) -> tuple[int, int]:
        """[lo, hi) element span touched (for bounds checks); (offset, offset) when empty."""
        if self.numel == 0:
            return self.offset, self.offset
        lo = hi = self.offset
        for size, stride in zip(self.sizes, self.strides):
            if stride >= 0:
                hi += (size - 1) * stride
            else:
                lo += (size - 1) * stride
        return lo, hi + 1


def contiguous_strides(shape: Iterable[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def full_region(shape: Iterable[int]) -> Region:
    shape = tuple(shape)
    return Region(0, shape, contiguous_strides(shape))


# Bytes per element of every dtype a plan may name; a plan naming any other dtype is refused on load.
ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as plans name it ("bfloat16"); KeyError naming it when unknown."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise KeyError(f"unknown dtype name {dtype!r}: plans name one of {sorted(ITEMSIZE)}") from None


@dataclass(frozen=True, slots=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


# ---- literals inside Call args -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Arg:
    """Placeholder for the i-th tensor input of a Call."""

    index: int


@dataclass(frozen=True, slots=True)
class DType:
    name: str


@dataclass(frozen=True, slots=True)
class Slice:
    start: int | None
    stop: int | None
    step: int | None


@dataclass(frozen=True, slots=True)
class Const:
    """A small constant tensor taken from the model at record time (e.g. an index tensor)."""

    dtype: str
    shape: tuple[int, ...]
    values: tuple  # flat, row-major


Literal = Union[None, bool, int, float, str, Arg, DType, Slice, Const, tuple, type(Ellipsis)]


# ---- leaves and expressions -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Source:
    name: str


@dataclass(frozen=True, slots=True)
class Call:
    op: str
    args: tuple  # Literal*, tensors replaced by Arg(i)
    kwargs: tuple  # ((key, Literal), ...)
    inputs: tuple  # View*
    out: int | None = None  # index into a tuple result (non-view multi-output ops)


@dataclass(frozen=True, slots=True)
class Full:
    value: float | int | bool
    sizes: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class Update:
    base: "Leaf"
    region: Region
    value: "View"


Leaf = Union[Source, Call, Full, Update]


@dataclass(frozen=True, slots=True)
class View:
    leaf: Leaf
    region: Region


@dataclass(frozen=True, slots=True)
class Write:
    param: str
    dst: Region
    src: View


@dataclass(frozen=True, slots=True)
class Fallback:
    """A checkpoint tensor whose loader could not be recorded: the consumer needs it whole and runs the real loader."""

    source: str
    op: str  # the op that stopped recording, e.g. "Tensor.item"
    reason: str
    loader: str  # qualified name of the weight_loader function, or "" when unknown


@dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    params: tuple[TensorMeta, ...]
    writes: tuple[Write, ...]
    fallbacks: tuple[Fallback, ...] = ()
    not_needed: tuple[str, ...] = ()

    def sources_read(self) -> set[str]:
        names: set[str] = set()
        for w in self.writes:
            sources(w.src.leaf, names)
        return names

    def format(self, sources: Mapping[str, TensorMeta]) -> str:
        shapes = {p.name: p.shape for p in self.params}
        source_shapes = _Shapes(sources)  # looked up per name: a plan's source table can hold ~70k tensors
        lines = [format_write(w, shapes, source_shapes) for w in self.writes]
        lines += [f"# fallback {f.source}: {f.op} in {f.loader or '?'}: {f.reason}" for f in self.fallbacks]
        return "\n".join(lines)


class _Shapes:
    """name -> shape, read through a TensorMeta mapping on demand."""

    def __init__(self, metas: Mapping[str, TensorMeta]):
        self.metas = metas

    def get(self, name: str, default=None):
        try:
            return self.metas[name].shape
        except KeyError:
            return default


def sources(leaf: Leaf, out: set[str] | None = None) -> set[str]:
    """Names of the checkpoint tensors a leaf reads (added to `out` when given)."""
    out = set() if out is None else out
    if isinstance(leaf, Source):
        out.add(leaf.name)
    elif isinstance(leaf, Call):
        for v in leaf.inputs:
            sources(v.leaf, out)
    elif isinstance(leaf, Update):
        sources(leaf.base, out)
        sources(leaf.value.leaf, out)
    return out


def is_pure_view(w: Write) -> bool:
    return isinstance(w.src.leaf, Source)


# ---- printing ---------------------------------------------------------------------------------------------
def region_str(shape: tuple[int, ...] | None, region: Region) -> str:
    """`[a:b, :]`-style text for a region of a contiguous tensor of `shape`, `.as_strided(...)` when it is not a box."""
    if shape is not None:
        text = _as_box(tuple(shape), region)
        if text is not None:
            return text
    return f".as_strided({list(region.sizes)}, {list(region.strides)}, {region.offset})"


def _as_box(shape: tuple[int, ...], region: Region) -> str | None:
    """Match region dims, in order, to base dims of equal stride; skipped base dims become integer indices and
    unmatched size-1 region dims become `None` (unsqueeze). Returns None when the region is not such a box."""
    base_strides = contiguous_strides(shape)
    starts, rem = [], region.offset
    for st, full in zip(base_strides, shape):
        q = rem // st if st else 0
        if q >= max(full, 1) and len(starts) > 0:
            return None
        starts.append(q)
        rem -= q * st
    if rem:
        return None
    parts, j = [], 0
    for sz, sd in zip(region.sizes, region.strides):
        k = j
        while k < len(shape) and not (base_strides[k] == sd or (sz == 1 and k == j)):
            k += 1
        if k == len(shape):
            if sz == 1:
                parts.append("None")
                continue
            return None
        if sz == 1 and base_strides[k] != sd and k == j:
            # a size-1 dim whose stride says nothing: take it as a 1-wide slice of base dim k
            pass
        for skipped in range(j, k):
            parts.append(str(starts[skipped]))
        if starts[k] + sz > shape[k]:
            return None
        parts.append(":" if (starts[k] == 0 and sz == shape[k]) else f"{starts[k]}:{starts[k] + sz}")
        j = k + 1
    for skipped in range(j, len(shape)):
        parts.append(str(starts[skipped]))
    return "[" + ", ".join(parts) + "]"


def leaf_str(leaf: Leaf, source_shapes: Mapping[str, tuple[int, ...]]) -> str:
    if isinstance(leaf, Source):
        return leaf.name
    if isinstance(leaf, Full):
        return f"full({list(leaf.sizes)}, {leaf.value!r}, {leaf.dtype})"
    if isinstance(leaf, Call):
        ins = [view_str(v, source_shapes) for v in leaf.inputs]
        args = ", ".join(_lit_str(a, ins) for a in leaf.args)
        kw = ", ".join(f"{k}={_lit_str(v, ins)}" for k, v in leaf.kwargs)
        text = f"{leaf.op}({', '.join(x for x in (args, kw) if x)})"
        return text if leaf.out is None else f"{text}[{leaf.out}]"
    if isinstance(leaf, Update):
        return (
            f"update({leaf_str(leaf.base, source_shapes)}, {region_str(None, leaf.region)}, "
            f"{view_str(leaf.value, source_shapes)})"
        )
    raise TypeError(f"not a plan leaf: {leaf!r}")


def view_str(view: View, source_shapes: Mapping[str, tuple[int, ...]]) -> str:
    base = leaf_str(view.leaf, source_shapes)
    shape = source_shapes.get(view.leaf.name) if isinstance(view.leaf, Source) else None
    if shape is not None and view.region == full_region(shape):
        return base
    return base + region_str(shape, view.region)


def format_write(
    w: Write, param_shapes: Mapping[str, tuple[int, ...]], source_shapes: Mapping[str, tuple[int, ...]]
) -> str:
    shape = param_shapes.get(w.param)
    dst = "" if shape is not None and w.dst == full_region(shape) else region_str(shape, w.dst)
    return f"{w.param}{dst} <- {view_str(w.src, source_shapes)}"


def _lit_str(lit, ins: list[str]) -> str:
    if isinstance(lit, Arg):
        return ins[lit.index]
    if isinstance(lit, DType):
        return f"torch.{lit.name}"
    if isinstance(lit, Slice):
        return f"{'' if lit.start is None else lit.start}:{'' if lit.stop is None else lit.stop}" + (
            "" if lit.step is None else f":{lit.step}"
        )
    if isinstance(lit, Const):
        vals = list(lit.values[:8]) + (["..."] if len(lit.values) > 8 else [])
        return f"const({lit.dtype}{list(lit.shape)}: {vals})"
    if lit is Ellipsis:
        return "..."
    if isinstance(lit, tuple):
        return "(" + ", ".join(_lit_str(x, ins) for x in lit) + ("," if len(lit) == 1 else "") + ")"
    return repr(lit)


def literal_ops(leaf: Leaf, out: list[str] | None = None) -> list[str]:
    """All op names a leaf tree uses (for allowlist checks and op histograms)."""
    out = [] if out is None else out
    if isinstance(leaf, Call):
        out.append(leaf.op)
        for v in leaf.inputs:
            literal_ops(v.leaf, out)
    elif isinstance(leaf, Update):
        literal_ops(leaf.base, out)
        literal_ops(leaf.value.leaf, out)
    return out


# ---- writes into tensors (see INPLACE_OPS) ---------------------------------------------------------------------
def made_by_plan(leaf: Leaf) -> bool:
    """True when evaluating `leaf` gives storage of its own: a constant, an update (evaluated on a copy of its base),
    a FRESH_OPS call, or an in-place op applied to such a tensor. A source, or any view op, may give the trainer's."""
    while True:
        if isinstance(leaf, (Full, Update)):
            return True
        if not isinstance(leaf, Call) or leaf.out is not None:
            return False
        if leaf.op in FRESH_OPS:
            return True
        target = inplace_target(leaf)
        if target is None:
            return False
        leaf = target.leaf


def inplace_target(call: Call) -> "View | None":
    """The input an in-place call writes into (its `args[0]`), or None when `call` is not a well-formed one."""
    if call.op not in INPLACE_OPS or not call.args or not isinstance(call.args[0], Arg):
        return None
    index = call.args[0].index
    return call.inputs[index] if 0 <= index < len(call.inputs) else None


def foreign_write(leaf: Leaf) -> str | None:
    """Why evaluating `leaf` could write into a tensor the plan did not make (an in-place op whose target is a source
    or a view of one, an `out=` argument), or None when it cannot. Structural: no tensor is touched."""
    stack = [leaf]
    while stack:
        node = stack.pop()
        if isinstance(node, Update):
            stack += [node.base, node.value.leaf]
        elif isinstance(node, Call):
            if any(key == "out" for key, _ in node.kwargs):
                return f"{node.op} takes out=, which would write into the tensor it names"
            if node.op in INPLACE_OPS:
                target = inplace_target(node)
                if target is None:
                    return f"in-place {node.op} does not name its target as its first argument"
                if not made_by_plan(target.leaf):
                    return (
                        f"in-place {node.op} writes into {leaf_str(target.leaf, {})[:120]}, which is not a tensor "
                        f"the plan made (only a copy such as Tensor.clone may be modified in place)"
                    )
            stack += [v.leaf for v in node.inputs]
    return None
