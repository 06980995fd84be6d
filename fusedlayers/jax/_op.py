"""What the JAX op modules share: the library, loaded (and its handlers registered with XLA) once
when fusedlayers.jax is first imported (without it, importing still works and the first call
raises fusedlayers.NotBuiltError), argument conversion and the custom calls.

The ops are XLA custom calls (jax.ffi.ffi_call) under jax.custom_vjp, so jit, grad and vmap
compose with them. Shapes, dtypes and attributes are static in JAX, so every argument error is
raised while tracing, as jax.numpy's are: the dtypes csrc does not take here (TypeError), csrc's
own rules (shapes, parameter dtypes, eps) by csrc itself, called through the library's
trace-time check of the op (`check`: ValueError, or TypeError for a dtype, with csrc's
message). Nothing wrong reaches XLA; the handlers keep csrc's checks as a backstop.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _csrc_check
from ..errors import NotBuiltError
from . import _library

try:
    lib = _library.load()
    LOAD_ERROR = None
except NotBuiltError as e:  # importing must not fail; the first call does
    lib, LOAD_ERROR = None, str(e)

FLOATS = (jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16)
_CSRC_DTYPES = {jnp.dtype(t): i for i, t in enumerate(FLOATS)}  # csrc's DType enum


def prepare(op: str, **tensors) -> list:
    """Checks the op can run here and converts each argument (None stays None) to a floating
    jax.Array or tracer."""
    if lib is None:
        raise NotBuiltError(LOAD_ERROR)
    out = []
    for name, value in tensors.items():
        if value is None:
            out.append(None)
            continue
        t = jnp.asarray(value)
        if t.dtype not in FLOATS:
            raise TypeError(f"fusedlayers.{op}: {name} must be float32, float64, float16 or "
                            f"bfloat16, got {t.dtype}")
        out.append(t)
    # Inside shard_map: a parameter the same on every device (invariant) meets rows that vary
    # across them, as in any jnp expression of both, so its gradient is the sum over devices.
    varying = [_varying(t) for t in out]
    every = set().union(*varying)
    return [t if t is None or v == every else
            jax.lax.pcast(t, tuple(sorted(every - v)), to="varying")
            for t, v in zip(out, varying)]


def check(op: str, *arguments) -> None:
    """csrc's argument checks of op for these static shapes, dtypes and attributes, through the
    library's fusedlayers_xla_<op>_check (backends/xla/<op>.cc), in its argument order; raises
    ValueError, or TypeError for a dtype, with csrc's message. Shapes with symbolic sizes
    (jax.export's shape polymorphism, as Keras infers output specs) are checked once traced
    with concrete ones, and by the handlers when they run."""
    if not _csrc_check.static(*arguments):
        return
    kind, message = _csrc_check.run(lib, op, csrc_dtype, *arguments)
    if kind:
        raise (TypeError if kind == 2 else ValueError)(message)


def platform_dependent(like, *, default, cuda):
    """jax.lax.platform_dependent(default=default, cuda=cuda), with `like` (an array the call
    computes on) choosing the branch where it is a concrete array: eagerly, JAX picks the
    default backend's branch, whose CUDA-only custom calls cannot compile for arrays placed on
    the CPU of a machine with a GPU."""
    if not isinstance(like, jax.core.Tracer) and hasattr(like, "devices"):
        return (cuda if {d.platform for d in like.devices()} == {"gpu"} else default)()
    return jax.lax.platform_dependent(default=default, cuda=cuda)


def _varying(t) -> set:
    """The shard_map axes over which t varies (none outside shard_map)."""
    if t is None:
        return set()
    return set(getattr(getattr(jax.typeof(t), "manual_axis_type", None), "varying", ()))


def call(target: str, results, *operands, roles: str, rows: int, workspace=None, **attributes):
    """The custom call fusedlayers_<target> on operands, as XLA sees one op that works row by
    row. results: jax.ShapeDtypeStruct(s) for the operands' shapes. roles: "<operands>-><results>",
    one letter each:
      x  the op's rows: `rows` leading dims (the same in each), then the dims the op works over
         (its first x operand is `x` below);
      r  x's row dims only (the norms' statistics);
      p  whole, in every row (parameters, empty stand-ins);
      s  a result summed over all rows (a parameter's gradient);
      m  relu_scale's mask: x's elements packed 32 to a 32-bit word.
    workspace: x -> bytes, a scratch result the call needs for this x, not returned.

    Under jit with x's row dims sharded (and a row's elements a multiple of 32 where there is a
    mask) each device runs the call on its own rows, its `s` results summed across them: no
    input is gathered. Under vmap the mapped axis becomes one more row dim where that is the
    same computation (no mapped `p` operand, no `s` result, masks of whole words), else the
    call runs once per mapped index."""
    single = isinstance(results, jax.ShapeDtypeStruct)
    spec = _RowSpec(target, tuple(results) if not single else (results,), roles, rows, workspace,
                    attributes)
    out = spec.function()(*operands)
    return out[0] if single else out


def same_varying(*operands) -> list:
    """The operands, each cast inside shard_map to vary over every axis any of them varies over
    (a custom_vjp's operands then all vary alike: the cast of a replicated parameter is what
    autodiff transposes into the sum of its gradient over the devices)."""
    varying = set().union(*map(_varying, operands))
    return [o if o is None or not (varying - _varying(o)) else
            jax.lax.pcast(o, tuple(sorted(varying - _varying(o))), to="varying")
            for o in operands]


def plain_call(target: str, results, *operands, **attributes):
    """The custom call fusedlayers_<target> as one whole op (not partitioned: a sharded jit
    hands it whole arrays; not batched): jax.ffi.ffi_call, its results typed as varying over
    the axes its operands vary over inside shard_map, so it runs there on each device's part."""
    out = jax.ffi.ffi_call(f"fusedlayers_{target}", results)(*operands, **attributes)
    varying = set().union(*map(_varying, operands))
    return jax.tree.map(lambda o: o if not (varying - _varying(o)) else jax.lax.pcast(
        o, tuple(sorted(varying - _varying(o))), to="varying"), out)


class _RowSpec:
    """One row-wise custom call: its local form, its sharding and its batching."""

    def __init__(self, target, results, roles, rows, workspace, attributes):
        self.target, self.results, self.rows = target, results, rows
        self.workspace, self.attributes = workspace, attributes
        self.in_roles, self.out_roles = roles.split("->")
        self.ix = self.in_roles.index("x")

    def local_results(self, x) -> list:
        """The results' shapes for this x (the whole array, one device's rows or a batch)."""
        out = []
        for role, r in zip(self.out_roles, self.results):
            shape = {"x": (*x.shape[:self.rows], *r.shape[self.rows:]), "r": x.shape[:self.rows],
                     "m": ((x.size + 31) // 32,)}.get(role, r.shape)
            out.append(jax.ShapeDtypeStruct(shape, r.dtype))
        if self.workspace is not None:
            out.append(jax.ShapeDtypeStruct((self.workspace(x),), jnp.uint8))
        return out

    def local(self, *operands):
        out = jax.ffi.ffi_call(f"fusedlayers_{self.target}",
                               self.local_results(operands[self.ix]))(*operands,
                                                                      **self.attributes)
        out = out[:len(self.out_roles)]
        # Inside shard_map the results vary over the axes the operands vary over.
        varying = set().union(*map(_varying, operands))
        if varying:
            out = [jax.lax.pcast(o, tuple(sorted(varying)), to="varying") for o in out]
        return tuple(out)

    def function(self):
        partitioned = custom_partitioning(self.local)
        partitioned.def_partition(self.partition, sharding_rule=self.sharding_rule)
        batched = custom_vmap(lambda *ops: partitioned(*ops))
        batched.def_vmap(self.vmap)
        return batched

    def _mask_words_per_row(self, x_shape):
        """A mask's words per row of x, or None where a row is not whole words."""
        per_row = math.prod(x_shape[self.rows:])
        return per_row // 32 if per_row % 32 == 0 else None

    def sharding_rule(self, mesh, operand_types, result_types):
        """Shardy's rule: factors r<i> for the row dims, shared; a factor of its own for each
        other dim (never split)."""
        replicated, sizes = [], {}
        rows = [f"r{i}" for i in range(self.rows)]
        words = self._mask_words_per_row(operand_types[self.ix].shape)
        if words is None and "m" in self.in_roles + self.out_roles:
            replicated += rows  # a mask not split by rows: every device needs all of it
        count = iter(range(1 << 30))

        def factors(role, ndim):
            if role == "x":
                cols = [f"u{next(count)}" for _ in range(ndim - self.rows)]
                replicated.extend(cols)
                return " ".join(rows + cols)
            if role == "r":
                return " ".join(rows)
            if role == "m" and words is not None:
                sizes["w"] = words
                return "(" + " ".join(rows + ["w"]) + ")"
            own = [f"u{next(count)}" for _ in range(ndim)]
            replicated.extend(own)
            return " ".join(own)

        ins = [factors(r, len(t.shape)) for r, t in zip(self.in_roles, operand_types)]
        outs = [factors(r, len(t.shape)) for r, t in zip(self.out_roles, result_types)]
        return (", ".join(ins) + " -> " + ", ".join(outs),
                {"need_replication_factors": tuple(replicated), **sizes})

    def partition(self, mesh, arg_shapes, result_shape):
        x = arg_shapes[self.ix]
        spec = tuple(x.sharding.spec) + (None,) * x.ndim
        row_spec = []
        for d in range(self.rows):
            axes = spec[d]
            n = math.prod(mesh.shape[a] for a in _axes(axes))
            row_spec.append(axes if axes is not None and x.shape[d] % n == 0 else None)
        if "m" in self.in_roles + self.out_roles and self._mask_words_per_row(x.shape) is None:
            row_spec = [None] * self.rows
        axes = tuple(a for s in row_spec for a in _axes(s))

        def sharding(role, ndim):
            if role == "x":
                return NamedSharding(mesh, P(*row_spec, *([None] * (ndim - self.rows))))
            if role == "r":
                return NamedSharding(mesh, P(*row_spec))
            if role == "m":
                return NamedSharding(mesh, P(axes or None))
            return NamedSharding(mesh, P())

        results = jax.tree.leaves(result_shape)
        arg_shardings = tuple(sharding(r, len(a.shape)) for r, a in zip(self.in_roles, arg_shapes))
        result_shardings = tuple(sharding(r, len(a.shape))
                                 for r, a in zip(self.out_roles, results))

        def lower(*operands):
            out = self.local(*operands)
            return tuple(jax.lax.psum(o, axes) if role == "s" and axes else o
                         for role, o in zip(self.out_roles, out))

        return mesh, lower, result_shardings, arg_shardings

    def vmap(self, axis_size, in_batched, *operands):
        """Folds the mapped axis into the rows where that is the same computation."""
        x = operands[self.ix]
        per_index = math.prod(x.shape[1:]) if in_batched[self.ix] else x.size
        fold = (not any(b and r == "p" for b, r in zip(in_batched, self.in_roles))
                and "s" not in self.out_roles
                and ("m" not in self.in_roles + self.out_roles or per_index % 32 == 0))
        if not fold:
            def one(batched):
                it = iter(batched)
                return call(self.target, self.results, *(next(it) if b else o for b, o in
                                                         zip(in_batched, operands)),
                            roles=f"{self.in_roles}->{self.out_roles}", rows=self.rows,
                            workspace=self.workspace, **self.attributes)
            out = jax.lax.map(one, [o for b, o in zip(in_batched, operands) if b])
            return tuple(out), (True,) * len(out)
        folded = []
        for b, role, o in zip(in_batched, self.in_roles, operands):
            if role in "xr" and not b:
                o = jnp.broadcast_to(o, (axis_size, *o.shape))
            elif role == "m":
                o = o.reshape(-1) if b else jnp.tile(o, axis_size)
            folded.append(o)
        results = tuple(
            jax.ShapeDtypeStruct((axis_size, *r.shape) if role in "xr" else
                                 (axis_size * r.shape[0],) if role == "m" else r.shape, r.dtype)
            for role, r in zip(self.out_roles, self.results))
        out = call(self.target, results, *folded, roles=f"{self.in_roles}->{self.out_roles}",
                   rows=self.rows + 1, workspace=self.workspace, **self.attributes)
        out = out if isinstance(out, tuple) else (out,)
        unbatch = []
        for role, o in zip(self.out_roles, out):
            if role == "m":
                o = o.reshape(axis_size, -1)
            elif role == "p":
                o = jnp.broadcast_to(o, (axis_size, *o.shape))
            unbatch.append(o)
        return tuple(unbatch), (True,) * len(unbatch)


def _axes(spec_entry) -> tuple:
    """The mesh axes of one PartitionSpec entry."""
    if spec_entry is None:
        return ()
    return tuple(spec_entry) if isinstance(spec_entry, tuple) else (spec_entry,)


def workspace(kind: str, cols: int):
    """The workspace (x -> bytes) of a backward pass over x viewed as rows x cols: the bytes the
    CUDA pass needs (none in a build without CUDA handlers; the CPU handlers use host memory of
    their own). kind: "norm" or "epilogue" (fusedlayers_xla_workspace_size)."""
    def size(x):
        rows = x.size // cols if cols else 0
        return lib.fusedlayers_xla_workspace_size({"norm": 0, "epilogue": 1}[kind], rows, cols,
                                                  csrc_dtype(x.dtype))
    return size


def csrc_dtype(dtype) -> int:
    """csrc's DType enum value of a floating dtype."""
    return _CSRC_DTYPES[jnp.dtype(dtype)]


def like(t) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(t.shape, t.dtype)


def stat_dtype(x):
    """The norms' statistics dtype for x (csrc/norm/norm.h)."""
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def absent(dtype):
    """An operand that stands for an absent optional tensor (its has_<name> attribute is
    False)."""
    return jnp.zeros((0,), dtype)


def shape_attr(shape) -> np.ndarray:
    return np.asarray(shape, np.int64)


def dresidual_result(h, dy) -> jax.ShapeDtypeStruct:
    """The add+norm backward's dresidual result: like h, or empty where h has dy's dtype (dx is
    the gradient of both x and residual)."""
    return jax.ShapeDtypeStruct((0,) if h.dtype == dy.dtype else h.shape, h.dtype)


def dresidual_role(h, dy) -> str:
    """_op.call's role of that result: rows like x, or a whole (empty) array."""
    return "p" if h.dtype == dy.dtype else "x"


def add_norm_work(x) -> dict:
    """The fewest bytes an add+norm moves (as fusedlayers.torch._op.add_norm_work)."""
    n = x.size * x.dtype.itemsize
    return {"fwd": 4 * n, "fwd+bwd": 8 * n}
