"""The bench's rows, shapes and outputs, shared by its torch, TensorFlow and JAX runs: a timing
as a Row (GB/s or TFLOP/s against the measured ceilings, by the op table's unit), the shapes the
op table gives a device, and the table, JSON and plot of the rows. Imports no framework."""

import json
from dataclasses import asdict, dataclass

from .. import ops


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    pass_: str
    impl: str
    ms: float
    rate: float  # GB/s or TFLOP/s
    unit: str
    pct_of_peak: float


def shapes(device_type: str, quick: bool) -> dict:
    """The shapes each op is timed at on a device of `device_type` ("cpu", "cuda"), by op: (rows, cols), or a GEMM's (m, k, n)."""
    return {op.name: list(op.bench_shapes[device_type][:1 if quick else None]) for op in ops.OPS}


def shape_name(shape) -> str:
    """(rows, cols) as "RxC", a GEMM's (m, k, n) as "(mxk)x(kxn)"."""
    if len(shape) == 3:
        m, k, n = shape
        return f"({m}x{k})x({k}x{n})"
    return "x".join(map(str, shape))


def row(op, shape: str, dtype_name: str, pass_: str, impl: str, ms: float, work: float,
         ceilings: dict) -> Row:
    """A timing as a Row: TFLOP/s of the flops, or GB/s of the bytes, the op's case counts."""
    if op.bench_unit == "TFLOP/s":
        rate, peak = work / ms / 1e9, ceilings[f"gemm_tflops_{dtype_name}"]
    else:
        rate, peak = work / ms / 1e6, ceilings["copy_gbs"]
    return Row(op.name, shape, dtype_name, pass_, impl, ms, rate, op.bench_unit,
               100 * rate / peak)


# What a fused row is compared with, by its framework's prefix: the unfused op ("x eager", under
# JAX XLA's own) and, in torch, torch.compile of it ("x compile").
_BASELINES = {"": ("eager", "compile"), "tf-": ("tf-eager", None), "jax-": ("jax-xla", None)}


FLOORS = ("copy", "gemm")  # the rows, of each framework, its other rows are judged by


def _framework(impl: str) -> str:
    """The prefix that names a row's framework: "" (torch), "tf-" or "jax-"."""
    return next((p for p in ("tf-", "jax-") if impl.startswith(p)), "")


def _speedups(rows: list[Row]) -> dict:
    """id(row) -> (x eager, x compile) for each fused row: the baseline's ms / the row's ms."""
    ms = {(r.op, r.shape, r.dtype, r.pass_, r.impl): r.ms for r in rows}
    out = {}
    for r in rows:
        prefix = _framework(r.impl)
        if not r.impl.removeprefix(prefix).startswith("fused"):
            continue
        key = (r.op, r.shape, r.dtype, r.pass_)
        out[id(r)] = tuple(None if b is None or (*key, b) not in ms else ms[(*key, b)] / r.ms
                           for b in _BASELINES[prefix])
    return out


def _floor_key(r: Row) -> tuple:
    """The floor row a row is judged by: its framework's "copy" of its op, shape and dtype (the
    forward's, for both passes: bytes per second at that size), or its framework's bare "gemm"
    of the same pass (the backward's GEMMs take other layouts, at other speeds)."""
    return (_framework(r.impl), r.op, r.shape, r.dtype, r.pass_ if r.unit != "GB/s" else None)


def per_size_floors(rows: list[Row], ceilings: dict) -> None:
    """Sets each row's % of peak against the larger of the device's ceiling and its floor row
    (_floor_key): a copy whose bytes fit in the CPU's caches runs faster than the large copy of
    the ceiling, and a GEMM's speed depends on its shape and on the GEMM library its framework
    calls (on the CPU, for bfloat16, oneDNN or a loop). A row above 100% ran faster than that
    floor."""
    floors = {_floor_key(r): r.rate for r in rows
              if r.impl.removeprefix(_framework(r.impl)) in FLOORS}
    for r in rows:
        ceiling = ceilings["copy_gbs"] if r.unit == "GB/s" else \
            ceilings.get(f"gemm_tflops_{r.dtype}", 0.0)
        peak = max(ceiling, floors.get(_floor_key(r), 0.0))
        if peak > 0:
            r.pct_of_peak = 100 * (r.rate / peak)  # exactly 100 for the floor row itself


def format_table(rows: list[Row], ceilings: dict, device_name: str) -> str:
    speedups = _speedups(rows)
    fmt = lambda v: f"{v:>9.2f}x" if v is not None else f"{'':>10}"  # noqa: E731
    lines = [f"device: {device_name}",
             "ceilings: " + ", ".join(f"{k} {v:.4g}" for k, v in ceilings.items()) +
             " (% peak: of the larger of the ceiling and the row's own copy or gemm row of its "
             "framework)",
             f"{'op':<12}{'shape':<24}{'dtype':<10}{'pass':<9}{'impl':<11}"
             f"{'ms':>10}{'rate':>12}{'unit':>9}{'% peak':>8}{'x eager':>10}{'x compile':>10}"]
    for r in rows:
        eager, compiled = speedups.get(id(r), (None, None))
        lines.append(f"{r.op:<12}{r.shape:<24}{r.dtype:<10}{r.pass_:<9}{r.impl:<11}"
                     f"{r.ms:>10.4f}{r.rate:>12.1f}{r.unit:>9}{r.pct_of_peak:>7.1f}%"
                     f"{fmt(eager)}{fmt(compiled)}")
    return "\n".join(lines)


def write_json(path: str, rows: list[Row], ceilings: dict, device_name: str) -> None:
    with open(path, "w") as f:
        json.dump({"device": device_name, "ceilings": ceilings,
                   "rows": [asdict(r) for r in rows]}, f, indent=1)


def plot(path: str, rows: list[Row], device_name: str) -> None:
    """One bar group per (op, shape, dtype, pass): % of the device ceiling for each impl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.op, r.shape, r.dtype, r.pass_) for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    pct = {(r.op, r.shape, r.dtype, r.pass_, r.impl): r.pct_of_peak for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.4 * len(keys)), 7))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ax.bar([k + i * width for k in range(len(keys))],
               [pct.get((*key, impl), 0) for key in keys], width, label=impl)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([" ".join(k) for k in keys], rotation=75, fontsize=7)
    ax.set_ylabel("% of measured copy bandwidth / GEMM rate")
    ax.set_title(f"fusedlayers bench on {device_name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
