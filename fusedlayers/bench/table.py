"""The bench's rows, shapes and outputs, shared by its torch, TensorFlow and JAX runs: a timing
as a Row (GB/s or TFLOP/s against the measured ceilings, by the op table's unit), the shapes the
op table gives a device, how sure each speedup is, and the table, JSON and plot of the rows.
Imports no framework.

Every row is timed in rounds, interleaved with the other rows of its op, shape, dtype and pass
(its baselines among them): a row's time is the median of its rounds, its spread their range. A
fused row's speedup over a baseline is the median of the per-round ratios (baseline / fused, the
two timed side by side in each round, so a drift of the host or the clocks hits both), its
interval their range; an interval that includes 1.0 is a tie."""

import json
import statistics
from dataclasses import asdict, dataclass, field

from .. import ops


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    pass_: str
    impl: str
    ms: float | None  # the median of rounds_ms; None where the row did not run
    rate: float | None  # GB/s or TFLOP/s
    unit: str
    pct_of_peak: float | None
    rounds_ms: list = field(default_factory=list)  # each round's time, interleaved
    # baseline impl -> {"x": median ratio, "lo", "hi": its range, "tie": lo <= 1 <= hi}
    speedups: dict = field(default_factory=dict)
    # On CUDA: the most memory one call allocated above what was allocated before it (the
    # inputs), its outputs and, for forward + backward, the gradients included, in MiB
    peak_mib: float | None = None
    not_run: str = ""  # why the row did not run (then it has no times)

    def spread_pct(self) -> float:
        """Half the range of the rounds, in % of the median."""
        return 50 * (max(self.rounds_ms) - min(self.rounds_ms)) / self.ms if self.rounds_ms \
            else 0.0


def shapes(device_type: str, quick: bool) -> dict:
    """The shapes each op is timed at on a device of `device_type` ("cpu", "cuda"), by op: (rows, cols), or a GEMM's (m, k, n)."""
    return {op.name: list(op.bench_shapes[device_type][:1 if quick else None]) for op in ops.OPS}


def shape_name(shape) -> str:
    """(rows, cols) as "RxC", a GEMM's (m, k, n) as "(mxk)x(kxn)"."""
    if len(shape) == 3:
        m, k, n = shape
        return f"({m}x{k})x({k}x{n})"
    return "x".join(map(str, shape))


def interleaved_rounds(loops: dict, rounds: int, ms, warm_up) -> dict:
    """name -> each round's ms of loops[name] (ms(loop)), the loops timed in turn each round,
    after warm_up(loop) ran each once; for a loop whose warm-up raises MemoryError (it does not
    fit the device), why it did not run (did_not_run), which its row shows."""
    loops, times = dict(loops), {}
    for name, loop in list(loops.items()):
        try:
            warm_up(loop)
        except MemoryError as e:
            times[name] = did_not_run(e)
            del loops[name]
    times.update({name: [] for name in loops})
    for _ in range(rounds):
        for name, loop in loops.items():
            times[name].append(ms(loop))
    return times


def out_of_memory(error: BaseException) -> bool:
    """Whether an error says the device ran out of memory (Python's MemoryError, torch's
    OutOfMemoryError, XLA's RESOURCE_EXHAUSTED, TensorFlow's ResourceExhaustedError)."""
    return isinstance(error, MemoryError) or type(error).__name__ in (
        "OutOfMemoryError", "ResourceExhaustedError") or "RESOURCE_EXHAUSTED" in str(error)


def did_not_run(error: BaseException) -> str:
    """Why a row did not run, from the error its warm-up raised: "out of memory" or the error's
    type, and the first line of its message."""
    first = (str(error).strip().splitlines() or [""])[0][:160]
    return f"{'out of memory' if out_of_memory(error) else type(error).__name__}: {first}"


def row(op, shape: str, dtype_name: str, pass_: str, impl: str, rounds_ms: list | str,
        work: float, ceilings: dict) -> Row:
    """A timing (each round's ms) as a Row: TFLOP/s of the flops, or GB/s of the bytes, the op's
    case counts, at the median round; where rounds_ms is a str, the row that did not run and
    why."""
    if isinstance(rounds_ms, str):
        return Row(op.name, shape, dtype_name, pass_, impl, None, None, op.bench_unit, None,
                   not_run=rounds_ms)
    ms = statistics.median(rounds_ms)
    if op.bench_unit == "TFLOP/s":
        rate, peak = work / ms / 1e9, ceilings[f"gemm_tflops_{dtype_name}"]
    else:
        rate, peak = work / ms / 1e6, ceilings["copy_gbs"]
    return Row(op.name, shape, dtype_name, pass_, impl, ms, rate, op.bench_unit,
               100 * rate / peak, list(rounds_ms))


# What a fused row is compared with, by its framework's prefix: the unfused op ("x eager", under
# JAX XLA's own) and, in torch, torch.compile of it ("x compile"). A variant "fused-<v>" is
# compared with "eager-<v>" and "compile-<v>" (the unfused computation of the same variant).
_BASELINES = {"": ("eager", "compile"), "tf-": ("tf-eager", None), "jax-": ("jax-xla", None)}


FLOORS = ("copy", "gemm")  # the rows, of each framework, its other rows are judged by


def _framework(impl: str) -> str:
    """The prefix that names a row's framework: "" (torch), "tf-" or "jax-"."""
    return next((p for p in ("tf-", "jax-") if impl.startswith(p)), "")


def _baselines(impl: str) -> tuple:
    """The impls a fused row is compared with (x eager, x compile), None where it has none."""
    prefix = _framework(impl)
    variant = impl.removeprefix(prefix).removeprefix("fused")
    return tuple(None if b is None else b + variant for b in _BASELINES[prefix])


def speedup(baseline_rounds: list, rounds: list) -> dict:
    """The speedup of a row over a baseline timed in the same rounds: the median of the
    per-round ratios, their range, and whether that range includes 1.0 (a tie)."""
    ratios = sorted(b / r for b, r in zip(baseline_rounds, rounds))
    lo, hi = ratios[0], ratios[-1]
    return {"x": statistics.median(ratios), "lo": lo, "hi": hi, "tie": lo <= 1.0 <= hi}


def judge(rows: list[Row]) -> None:
    """Sets each fused row's speedups over its baselines (_baselines) timed in the same run."""
    by_key = {(r.op, r.shape, r.dtype, r.pass_, r.impl): r for r in rows}
    for r in rows:
        if not r.impl.removeprefix(_framework(r.impl)).startswith("fused"):
            continue
        for b in _baselines(r.impl):
            base = by_key.get((r.op, r.shape, r.dtype, r.pass_, b))
            if base is not None and len(base.rounds_ms) == len(r.rounds_ms) > 0:
                r.speedups[b] = speedup(base.rounds_ms, r.rounds_ms)


def format_speedup(s: dict | None) -> str:
    """"1.23x 1.20-1.26", and " tie" where the range includes 1.0."""
    if s is None:
        return ""
    return f"{s['x']:.2f}x {s['lo']:.2f}-{s['hi']:.2f}" + (" tie" if s["tie"] else "")


def _floor_key(r: Row) -> tuple:
    """The floor row a row is judged by: its framework's "copy" of its op, shape and dtype (the
    forward's, for both passes: bytes per second at that size), or its framework's bare "gemm"
    of the same pass (the backward's GEMMs take other layouts, at other speeds)."""
    return (_framework(r.impl), r.op, r.shape, r.dtype, r.pass_ if r.unit != "GB/s" else None)


def per_size_floors(rows: list[Row], ceilings: dict) -> None:
    """Sets each row's % of peak against the larger of the device's ceiling and its floor row
    (_floor_key): a copy whose bytes fit in the CPU's caches runs faster than the large copy of
    the ceiling, and a GEMM's speed depends on its shape and on the GEMM library its framework
    calls (on the CPU, for bfloat16, oneDNN or a loop). A row faster than that floor (a copy
    kernel that is not the fastest way to move a cache-resident size, or a size without a floor
    row) shows that the floor was not the ceiling there: the fastest row judged by the same
    floor is then the 100%, so no row reads above it."""
    rows = [r for r in rows if not r.not_run]
    floors = {}  # the floor row's rate, or a faster row's judged by it
    for r in rows:
        floors[_floor_key(r)] = max(floors.get(_floor_key(r), 0.0), r.rate)
    for r in rows:
        ceiling = ceilings["copy_gbs"] if r.unit == "GB/s" else \
            ceilings.get(f"gemm_tflops_{r.dtype}", 0.0)
        peak = max(ceiling, floors.get(_floor_key(r), 0.0))
        if peak > 0:
            r.pct_of_peak = 100 * (r.rate / peak)  # exactly 100 for the floor row itself


def format_table(rows: list[Row], ceilings: dict, device_name: str) -> str:
    """The rows as a table; judge(rows) first gives the fused rows their speedups."""
    rounds = max((len(r.rounds_ms) for r in rows), default=0)
    op_w = max([12, *(len(r.op) + 1 for r in rows)])
    shape_w = max([24, *(len(r.shape) + 1 for r in rows)])
    lines = [f"device: {device_name}",
             "ceilings: " + ", ".join(f"{k} {v:.4g}" for k, v in ceilings.items()) +
             " (% peak: of the larger of the ceiling and the row's own copy or gemm row of its "
             "framework)",
             f"ms: the median of {rounds} interleaved rounds, +-%: half their range; x eager, "
             f"x compile: the median of the per-round ratios and their range, a tie where it "
             f"includes 1.0",
             (f"{'op':<{op_w}}{'shape':<{shape_w}}{'dtype':<10}{'pass':<9}{'impl':<12}"
              f"{'ms':>10}{'+-%':>6}{'rate':>10}{'unit':>9}{'% peak':>8}  {'x eager':<21}"
              f"{'x compile':<21}" + ("peak MiB" if any(r.peak_mib is not None for r in rows)
                                      else "")).rstrip()]
    for r in rows:
        key = f"{r.op:<{op_w}}{r.shape:<{shape_w}}{r.dtype:<10}{r.pass_:<9}{r.impl:<12}"
        if r.not_run:
            lines.append(f"{key}  did not run: {r.not_run}")
            continue
        eager, compiled = (r.speedups.get(b) if b else None for b in _baselines(r.impl))
        peak = "" if r.peak_mib is None else f"{r.peak_mib:.0f}"
        lines.append(f"{key}{r.ms:>10.4f}{r.spread_pct():>6.1f}{r.rate:>10.1f}{r.unit:>9}"
                     f"{r.pct_of_peak:>7.1f}%  {format_speedup(eager):<21}"
                     f"{format_speedup(compiled):<21}{peak}".rstrip())
    return "\n".join(lines)


def write_json(path: str, rows: list[Row], ceilings: dict, device_name: str) -> None:
    """The rows with their rounds and speedups (judge(rows) first)."""
    with open(path, "w") as f:
        json.dump({"device": device_name, "ceilings": ceilings,
                   "rows": [asdict(r) for r in rows]}, f, indent=1)


def plot(path: str, rows: list[Row], device_name: str) -> None:
    """One bar group per (op, shape, dtype, pass): % of the device ceiling for each impl, with
    the range of its rounds; a fused row that ties its eager baseline is hatched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.not_run]
    keys = list(dict.fromkeys((r.op, r.shape, r.dtype, r.pass_) for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    by_key = {(r.op, r.shape, r.dtype, r.pass_, r.impl): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.4 * len(keys)), 7))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        found = [(k, by_key[(*key, impl)]) for k, key in enumerate(keys)
                 if (*key, impl) in by_key]
        xs = [k + i * width for k, _ in found]
        pct = [r.pct_of_peak for _, r in found]
        # % of peak goes as 1 / ms: the slowest round gives the bar's low end
        err = [[p - p * r.ms / max(r.rounds_ms or [r.ms]) for p, (_, r) in zip(pct, found)],
               [p * r.ms / min(r.rounds_ms or [r.ms]) - p for p, (_, r) in zip(pct, found)]]
        bars = ax.bar(xs, pct, width, yerr=err, capsize=1.5, label=impl)
        for bar, (_, r) in zip(bars, found):
            eager = _baselines(r.impl)[0]
            if eager in r.speedups and r.speedups[eager]["tie"]:
                bar.set_hatch("//")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([" ".join(k) for k in keys], rotation=75, fontsize=7)
    ax.set_ylabel("% of measured copy bandwidth / GEMM rate (bars: range of the rounds)")
    ax.set_title(f"fusedlayers bench on {device_name} (hatched: a fused row that ties eager)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
