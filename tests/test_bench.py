"""`python -m fusedlayers bench` on the CPU: rows for the chosen ops, JSON output, bad options, and
the memory bench's byte counts."""

import ctypes
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from fusedlayers import ops as fl_ops
from fusedlayers import __main__ as main
from fusedlayers.bench import memory as mem, models as model_bench, ops as bench, table


def test_run_reports_each_pass_and_impl_of_the_chosen_ops():
    rows, ceilings = bench.run("cpu", ("float32",), quick=True, compile=False, reps=2,
                               op_names=("relu_scale", "layer_norm"), tensorflow=False, rounds=3)
    assert {r.op for r in rows} == {"relu_scale", "layer_norm"}
    assert {(r.pass_, r.impl) for r in rows} == {("fwd", "fused"), ("fwd", "eager"),
                                                 ("fwd", "copy"), ("fwd+bwd", "fused"),
                                                 ("fwd+bwd", "eager")}
    assert ceilings["copy_gbs"] > 0
    for r in rows:
        assert r.ms > 0 and r.unit == "GB/s"
        assert len(r.rounds_ms) == 3 and r.ms == statistics.median(r.rounds_ms)
        assert r.pct_of_peak == pytest.approx(100 * r.rate / ceilings["copy_gbs"])
    table.per_size_floors(rows, ceilings)
    assert all(r.pct_of_peak <= 100 for r in rows if r.impl == "copy")


def test_cpu_precompile_fills_inductors_caches_from_two_processes(tmp_path):
    """Each case precompile compiles (here and in its second process) is then compiled by the
    timed run from Inductor's caches: FX graph cache hits only, no misses."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    shape = fl_ops.OPS[0].bench_shapes["cpu"][0]
    cases = [(fl_ops.OPS[0].name, shape, dtype) for dtype in ("float32", "bfloat16")]
    with temporary_cache_dir(str(tmp_path / "inductor")):
        bench.precompile(cases, peers=False)
        counters.clear()
        claims = tmp_path / "claims"
        claims.mkdir()
        bench._compile_cases(json.dumps({"cases": cases, "peers": False, "claims": str(claims)}))
    assert counters["inductor"]["fxgraph_cache_miss"] == 0, dict(counters["inductor"])
    assert counters["inductor"]["fxgraph_cache_hit"] >= 2 * len(cases)


def _row(impl, rounds, rate=1.0, pass_="fwd", op="layer_norm"):
    return table.Row(op, "8x8", "float32", pass_, impl, statistics.median(rounds), rate, "GB/s",
                     0.0, list(rounds))


def test_table_gives_speedups_and_judges_rows_by_their_own_size_copy():
    rows = [_row("fused", [1.0, 1.0, 1.1], 50.0), _row("eager", [2.0, 2.1, 2.0], 25.0),
            _row("compile", [1.5, 1.5, 1.5], 33.0), _row("copy", [0.8, 0.8, 0.8], 60.0),
            _row("jax-fused", [1.0, 1.0, 1.0], 50.0), _row("jax-xla", [3.0, 3.0, 3.0], 17.0)]
    table.per_size_floors(rows, {"copy_gbs": 40.0})  # the in-cache copy is the faster
    assert [round(r.pct_of_peak, 3) for r in rows[:4]] == [83.333, 41.667, 55.0, 100.0]
    table.judge(rows)
    lines = table.format_table(rows, {"copy_gbs": 40.0}, "cpu").splitlines()
    fused = next(line for line in lines if " fused " in line)
    # per-round ratios eager / fused: 2, 2.1, 1.82; compile / fused: 1.5, 1.5, 1.36
    assert fused.split()[-4:] == ["2.00x", "1.82-2.10", "1.50x", "1.36-1.50"]
    assert rows[0].spread_pct() == pytest.approx(50 * 0.1 / 1.0)
    assert next(line for line in lines if "jax-fused" in line).split()[-2:] == ["3.00x",
                                                                              "3.00-3.00"]
    assert next(line for line in lines if "  eager " in line).rstrip().endswith("%")


def test_a_speedup_whose_rounds_straddle_one_is_a_tie(tmp_path):
    rows = [_row("fused", [1.0, 1.0, 1.0]), _row("eager", [1.05, 0.97, 1.1]),
            _row("compile", [1.2, 1.3, 1.25])]
    table.judge(rows)
    eager, compiled = rows[0].speedups["eager"], rows[0].speedups["compile"]
    assert eager == {"x": 1.05, "lo": 0.97, "hi": 1.1, "tie": True}
    assert not compiled["tie"] and compiled["lo"] == 1.2
    line = table.format_table(rows, {"copy_gbs": 1.0}, "cpu").splitlines()[4]
    assert "1.05x 0.97-1.10 tie" in line and "1.25x 1.20-1.30" in line
    path = tmp_path / "rows.json"
    table.write_json(str(path), rows, {"copy_gbs": 1.0}, "cpu")
    fused = json.loads(path.read_text())["rows"][0]
    assert fused["rounds_ms"] == [1.0, 1.0, 1.0] and fused["speedups"]["eager"]["tie"] is True
    table.plot(str(tmp_path / "rows.png"), rows, "cpu")  # the tie hatched, rounds as error bars
    assert (tmp_path / "rows.png").stat().st_size > 0


def test_a_variant_is_judged_against_its_own_unfused_baseline():
    """fused-tanh against eager-tanh (not the erf eager row); a variant without one gets none."""
    rows = [_row("fused", [1.0]), _row("eager", [2.0]), _row("fused-tanh", [3.0]),
            _row("eager-tanh", [4.5]), _row("fused-w32", [1.0])]
    table.judge(rows)
    assert set(rows[2].speedups) == {"eager-tanh"}
    assert rows[2].speedups["eager-tanh"]["x"] == 1.5
    assert rows[4].speedups == {}


def test_floors_are_each_frameworks_own_and_gemm_floors_each_passes():
    def rows_of(impl, pass_, rate, op="linear_gelu", unit="TFLOP/s"):
        return table.Row(op, "s", "bfloat16", pass_, impl, 1.0, rate, unit, 0.0)
    rows = [rows_of("fused", "fwd", 9.0), rows_of("gemm", "fwd", 10.0),
            rows_of("fused", "fwd+bwd", 2.0), rows_of("gemm", "fwd+bwd", 2.5),
            rows_of("tf-fused", "fwd", 40.0), rows_of("tf-gemm", "fwd", 50.0),
            rows_of("jax-fused", "fwd", 0.75),  # no jax-gemm row: the device's ceiling
            rows_of("fused", "fwd+bwd", 8.0, "layer_norm", "GB/s"),
            rows_of("copy", "fwd", 10.0, "layer_norm", "GB/s"),
            rows_of("tf-fused", "fwd", 8.0, "layer_norm", "GB/s"),  # no tf-copy row
            rows_of("fused", "fwd", 12.0, "rms_norm", "GB/s"),  # faster than its copy row
            rows_of("copy", "fwd", 10.0, "rms_norm", "GB/s")]
    table.per_size_floors(rows, {"copy_gbs": 5.0, "gemm_tflops_bfloat16": 1.0})
    # no row above 100%: a size's fastest row is its 100% where it beats the floor row
    assert [round(r.pct_of_peak) for r in rows] == [90, 100, 80, 100, 80, 100, 75, 80, 100, 100,
                                                    100, 83]


def test_run_half_precision_adds_float32_parameter_rows():
    rows, _ = bench.run("cpu", ("bfloat16",), quick=True, compile=False, reps=1,
                        op_names=("rms_norm",), tensorflow=False, rounds=2)
    impls = {(r.op, r.pass_, r.impl) for r in rows}
    assert {("rms_norm", p, impl) for p in ("fwd", "fwd+bwd")
            for impl in ("fused-w32", "eager-w32")} <= impls
    assert all(len(r.rounds_ms) == 2 for r in rows)


def test_run_adds_tensorflow_rows_on_the_cpu():
    pytest.importorskip("tensorflow")
    rows, _ = bench.run("cpu", ("float32",), quick=True, compile=False, reps=1, rounds=1)
    tf_rows = {(r.op, r.pass_, r.impl) for r in rows if r.impl.startswith("tf-")}
    gemm_bound = {op.name for op in fl_ops.OPS if op.bench_unit == "TFLOP/s"}
    assert tf_rows == {(op, p, impl) for op in bench.OPS for p in ("fwd", "fwd+bwd")
                       for impl in ("tf-fused", "tf-eager")} | {
        (op, p, "tf-gemm") for op in gemm_bound for p in ("fwd", "fwd+bwd")} | {
        (op, "fwd", "tf-copy") for op in bench.OPS if op not in gemm_bound}
    assert all(r.ms > 0 for r in rows)


def test_tensorflow_bench_rows():
    """`bench --framework tensorflow` (here on the CPU): fused and unfused rows, each also under
    XLA, the floors, and speedups against the unfused rows of the same kind."""
    pytest.importorskip("tensorflow")
    from fusedlayers.bench import tensorflow_ops
    rows, ceilings = tensorflow_ops.run(("float32",), quick=True, reps=1,
                                        op_names=("relu_scale", "linear_gelu"), iters=2,
                                        rounds=2)
    assert {(r.op, r.pass_, r.impl) for r in rows} == {
        (op, p, impl) for op in ("relu_scale", "linear_gelu") for p in ("fwd", "fwd+bwd")
        for impl in ("tf-fused", "tf-eager", "tf-fused-xla", "tf-eager-xla")} | {
        ("linear_gelu", p, "tf-gemm") for p in ("fwd", "fwd+bwd")} | {
        ("relu_scale", "fwd", "tf-copy")}
    assert all(r.ms > 0 and len(r.rounds_ms) == 2 for r in rows)
    assert ceilings["copy_gbs"] > 0 and ceilings["gemm_tflops_float32"] > 0
    table.judge(rows)
    judged = {r.impl: set(r.speedups) for r in rows if r.op == "relu_scale" and r.pass_ == "fwd"}
    assert judged["tf-fused"] == {"tf-eager"} and judged["tf-fused-xla"] == {"tf-eager-xla"}


FAULTS_OF_A_TEMPORARY = """
import ctypes, resource, torch
from fusedlayers.bench import ops
# glibc's initial thresholds, fixed: left dynamic, they rise after the first free of an mmapped
# block and whether a call's temporaries then exceed the trim threshold depends on what else
# sits at the heap's top.
mallopt = ctypes.CDLL(None).mallopt
mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
mallopt(ops.M_TRIM_THRESHOLD, 128 << 10)

def faults_per_call(x):
    for _ in range(10):  # the heap grows to its steady size
        torch.relu(x) * 0.5
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.relu(x) * 0.5
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

# relu(x) * 0.5 frees a temporary of x's size each call: 16 MiB, and 40 MiB (above glibc's
# largest mmap threshold, 32 MiB)
small, large = torch.randn(2048, 2048), torch.randn(2048, 5120)
default = faults_per_call(small)
print(default, ops.keep_freed_memory(), faults_per_call(small), faults_per_call(large))
"""


def test_keep_freed_memory_stops_the_page_faults_of_each_calls_temporaries():
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("the C library has no mallopt (not glibc)")
    out = subprocess.run([sys.executable, "-c", FAULTS_OF_A_TEMPORARY], check=True,
                         capture_output=True, text=True).stdout.split()
    default, kept, after, large = float(out[0]), out[1], float(out[2]), float(out[3])
    assert default > 1000  # glibc gave the memory back: 4096 pages per 16 MiB
    assert kept == "True" and after < 64 and large < 64, out


def test_run_rejects_unknown_ops():
    with pytest.raises(ValueError, match="layernorm"):
        bench.run("cpu", op_names=("layernorm",))


def test_cli_writes_json_and_starts_quietly(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-m", "fusedlayers", "bench", "--device", "cpu",
                           "--quick", "--no-compile", "--reps", "2", "--rounds", "2",
                           "--dtypes", "float32", "--ops", "relu_scale,linear_gelu", "--json",
                           str(out)],
                          check=True, capture_output=True, text=True, env=env)
    tf = importlib.util.find_spec("tensorflow") is not None
    assert done.stdout.splitlines()[0] == (f"fusedlayers: torch loaded{', tensorflow loaded' * tf}"
                                           " (python -m fusedlayers info: details)")
    assert done.stderr == "", done.stderr  # TensorFlow's start-up logs among it
    data = json.loads(out.read_text())
    assert {r["op"] for r in data["rows"]} == {"relu_scale", "linear_gelu"}
    assert all(r["unit"] == ("TFLOP/s" if r["op"] == "linear_gelu" else "GB/s") and r["ms"] > 0
               for r in data["rows"])
    floors = {(r["op"], r["pass_"], r["impl"]) for r in data["rows"]}
    assert floors >= {("linear_gelu", "fwd", "gemm"), ("linear_gelu", "fwd+bwd", "gemm"),
                      ("relu_scale", "fwd", "copy")}
    fused = [r for r in data["rows"] if r["impl"] in ("fused", "fused-tanh", "tf-fused")]
    assert fused and all(len(r["rounds_ms"]) == 2 and set(r["speedups"]) <= {
        "eager", "eager-tanh", "tf-eager"} and r["speedups"] for r in fused)


@pytest.mark.parametrize("name", ("bert-base", "llama", "llama-lm"))
def test_model_bench_tiny_on_cpu(name):
    rows = model_bench.run(name, "cpu", batches=(2,), precisions=("fp32", "bf16"),
                           modes=("eager",), rounds=2, steps=1, warmup=1, tiny=True,
                           log=lambda line: None)
    assert [(r.precision, r.batch, r.mode) for r in rows] == [("fp32", 2, "eager"),
                                                             ("bf16", 2, "eager")]
    for r in rows:
        assert r.unfused_ms > 0 and r.fused_ms > 0
        assert r.speedup == pytest.approx(r.unfused_ms / r.fused_ms)
        assert r.unfused_gpu_ms is None and r.fused_peak_mb is None  # CPU: no GPU figures
    fp32, bf16 = rows
    # The fused model computes the same function: float32 rounding, and bf16's.
    assert 0 < fp32.first_forward_rel_diff <= 1e-5
    assert bf16.first_forward_rel_diff <= 1e-2


@pytest.mark.parametrize("name", ("llama-lm", "llama-8b-layers"))
def test_model_bench_fp8_variants_tiny_on_cpu(name):
    """With fp8 each case's row carries fuse(model, fp8=) with both recipes (blockwise also
    keeping its FP8 W^T, and with x^T in tiles) beside the bf16 fused model, timed in the same
    rounds (torchao's only with peers, on CUDA)."""
    rows = model_bench.run(name, "cpu", batches=(1,), precisions=("bf16",), modes=("eager",),
                           rounds=1, steps=1, warmup=1, tiny=True, log=lambda line: None,
                           fp8=True)
    (r,) = rows
    assert r.model == name and not r.not_run
    assert sorted(r.fp8) == ["fp8 blockwise", "fp8 blockwise, W^T kept",
                             "fp8 blockwise, x^T tiles", "fp8 tensorwise"]
    for v in r.fp8.values():
        assert v["ms"] > 0 and v["vs_fused"] == pytest.approx(r.fused_ms / v["ms"])
    assert "fp8 blockwise:" in model_bench.format_row(r)


@pytest.mark.parametrize("name", ("bert-base", "llama"))
def test_keras_model_bench_tiny_on_the_jax_backend(name, tmp_path):
    """Keras' functional models on JAX, unfused against fused (llama: its Attention layer reshapes
    by ops.shape, so Keras infers the fused rotation's output with a symbolic batch size)."""
    pytest.importorskip("keras")
    pytest.importorskip("jax")
    out = tmp_path / "keras.json"
    result = subprocess.run(
        [sys.executable, "-m", "fusedlayers", "bench", "--framework", "jax", "--model", name,
         "--tiny", "--batch", "2", "--precision", "float32", "--rounds", "1", "--steps", "1",
         "--json", str(out)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert (row["model"], row["batch"], row["precision"]) == (f"{name}-tiny", 2, "float32")
    assert row["unfused_ms"] > 0 and row["fused_ms"] > 0
    # The fused model computes the same function (same weights): float32 rounding only.
    assert 0 < row["first_forward_rel_diff"] <= 1e-5


def test_keras_model_rows_without_keras_say_why(monkeypatch, capsys):
    """Where keras is not installed (the GPU host's image) the Keras rows say so, not a
    traceback."""
    pytest.importorskip("jax")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "keras" else find_spec(name, *a))
    assert main.bench(["--framework", "jax", "--model", "llama", "--tiny"]) == 0
    assert "llama: did not run: keras is not installed" in capsys.readouterr().out


def test_llm_bench_tiny_flax_and_keras_with_a_switch_variant(tmp_path):
    """llama-lm: the Flax NNX rows (with --fp8 its FP8 variants too), then a Keras row per
    FUSEDLAYERS_JAX_IMPL setting (the defaults, and RoPE and the norms as XLA's formulas) and per
    FP8 recipe (the projections as Fp8Dense, their programs calling the FP8 kernels); the
    losses agree."""
    pytest.importorskip("keras")
    pytest.importorskip("flax")
    out = tmp_path / "keras.json"
    result = subprocess.run(
        [sys.executable, "-m", "fusedlayers", "bench", "--framework", "jax", "--model",
         "llama-lm", "--tiny", "--batch", "2", "--precision", "float32", "--rounds", "1",
         "--steps", "1", "--fp8", "--jax-impl", ";rope=xla,rms_norm=xla,add_rms_norm=xla",
         "--json", str(out)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stderr[-3000:]
    flax_row = next(line for line in result.stdout.splitlines()
                    if line.startswith("flax llama-lm-tiny"))
    assert float(flax_row.split()[-1]) <= 1e-4  # bfloat16 computation: the first losses
    for recipe in ("blockwise", "tensorwise"):  # FP8: within its rounding of the first loss
        fp8_row = next(line for line in result.stdout.splitlines()
                       if line.startswith(f"flax llama-lm-tiny fp8 {recipe}"))
        assert float(fp8_row.split()[-1]) <= 1e-2, fp8_row
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == [
        "llama-lm-tiny", "llama-lm-tiny [rope=xla,rms_norm=xla,add_rms_norm=xla]",
        "llama-lm-tiny fp8 blockwise", "llama-lm-tiny fp8 tensorwise"]
    assert all(r["fused_ms"] > 0 for r in rows)
    assert all(r["first_forward_rel_diff"] <= 1e-5 for r in rows[:2])
    assert all(r["first_forward_rel_diff"] <= 1e-2 for r in rows[2:])  # FP8's rounding


def test_an_ops_row_that_cannot_run_says_why_in_the_row():
    """A variant whose warm-up runs out of memory, or a peer's that fails, is a row saying why;
    the table prints no numbers (no nan) for it. Any other error of our own rows is raised."""
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    def broken():
        raise RuntimeError("liger: no kernel for this shape")

    x = torch.randn(64, 64)
    times = bench.time_rounds({"fused": lambda: x + 1, "eager": oom, "liger": broken},
                              torch.device("cpu"), rounds=2, fallible={"liger"})
    assert len(times["fused"]) == 2
    op = fl_ops.OPS[0]
    rows = [table.row(op, "64x64", "float32", "fwd", impl, ms, 1e6, {"copy_gbs": 1.0})
            for impl, ms in times.items()]
    table.per_size_floors(rows, {"copy_gbs": 1.0})
    table.judge(rows)
    text = table.format_table(rows, {"copy_gbs": 1.0}, "cpu")
    assert "nan" not in text.lower()
    lines = text.splitlines()[4:]  # the rows, after the header
    assert next(line for line in lines if " eager " in line).endswith(
        "did not run: out of memory: CUDA out of memory. Tried to allocate 8.00 GiB")
    assert next(line for line in lines if " liger " in line).endswith(
        "did not run: RuntimeError: liger: no kernel for this shape")
    with pytest.raises(RuntimeError, match="no kernel"):
        bench.time_rounds({"fused": broken}, torch.device("cpu"), rounds=1)


def test_interleaved_rounds_rows_that_do_not_fit_say_so():
    """The JAX and TensorFlow benches' loops: one whose warm-up is out of memory is a row that
    says so."""
    def warm_up(loop):
        loop()

    def too_big():
        raise MemoryError("RESOURCE_EXHAUSTED: Out of memory allocating 87 GiB")

    times = table.interleaved_rounds({"jax-fused": lambda: None, "jax-xla": too_big}, 2,
                                     lambda loop: 1.0, warm_up)
    assert times["jax-fused"] == [1.0, 1.0]
    row = table.row(fl_ops.OPS[0], "8x8", "float32", "fwd", "jax-xla", times["jax-xla"], 1.0,
                    {"copy_gbs": 1.0})
    assert row.not_run.startswith("out of memory: RESOURCE_EXHAUSTED") and row.ms is None
    assert "did not run: out of memory" in table.format_table([row], {"copy_gbs": 1.0}, "cpu")


@pytest.mark.parametrize("fits_steps", [0, 1], ids=["warming-up", "timed"])
def test_model_bench_row_that_cannot_run_says_why(monkeypatch, fits_steps):
    """The unfused model out of memory, in its warm-up or only once the timed rounds run beside
    the other variants: its row says so, with the fused model's time."""
    step = model_bench._Variant.step
    unfused_steps = []

    def unfused_out_of_memory(self, inputs):
        if not hasattr(self.model, "fusedlayers_report"):  # fuse() marks the fused model
            unfused_steps.append(1)
            if len(unfused_steps) > fits_steps:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")
        return step(self, inputs)
    monkeypatch.setattr(model_bench._Variant, "step", unfused_out_of_memory)
    row, = model_bench.run("llama", "cpu", batches=(2,), precisions=("fp32",), modes=("eager",),
                           rounds=1, steps=1, warmup=1, tiny=True, log=lambda line: None)
    assert row.unfused_ms is None and row.speedup is None and row.fused_ms > 0
    text = model_bench.format_row(row)
    assert "nan" not in text.lower()
    assert text.endswith("unfused did not run: out of memory: CUDA out of memory. Tried to "
                         "allocate 3.91 GiB")


def test_flax_model_bench_row_that_cannot_run_says_why(monkeypatch):
    """The Flax bench's unfused step out of memory (XLA's RESOURCE_EXHAUSTED): its row says so."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("flax")
    from fusedlayers.bench import flax_models
    train_step = flax_models._train_step

    class OutOfMemory:
        def lower(self, *args):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                             "allocate 12.5GiB")

    built = []

    def steps(model):  # the unfused model is built first
        built.append(model)
        return (OutOfMemory(), None) if len(built) == 1 else train_step(model)
    monkeypatch.setattr(flax_models, "_train_step", steps)
    lines = []
    text = flax_models.run("llama-lm", 2, rounds=1, steps=1, tiny=True, log=lines.append)
    assert "nan" not in text.lower()
    assert text.endswith("unfused did not run: out of memory: RESOURCE_EXHAUSTED: Out of "
                         "memory while trying to allocate 12.5GiB")


def test_model_bench_rejects_unknown_precision():
    with pytest.raises(ValueError, match="fp8"):
        model_bench.run("bert-base", "cpu", precisions=("fp8",))


def test_cli_model_bench_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "model.json", tmp_path / "model.png"
    subprocess.run([sys.executable, "-m", "fusedlayers", "bench", "--device", "cpu", "--model",
                    "gpt2", "--tiny", "--batch", "2", "--precision", "fp32", "--modes", "eager",
                    "--rounds", "1", "--steps", "1", "--json", str(out), "--plot", str(png)],
                   check=True, capture_output=True)
    data = json.loads(out.read_text())
    assert [(r["model"], r["batch"]) for r in data["rows"]] == [("gpt2", 2)]
    assert png.stat().st_size > 0


def test_cli_model_bench_under_ddp(tmp_path):
    """`--distributed` under torchrun (two processes, gloo on the CPU): both models train in DDP
    and the first process alone writes the rows."""
    out = tmp_path / "model.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "fusedlayers", "bench", "--device", "cpu", "--model", "bert-base", "--tiny",
         "--distributed", "--batch", "2", "--precision", "fp32", "--modes", "eager", "--rounds",
         "1", "--steps", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "x 2 processes, DDP" in data["device"]
    assert [(r["model"], r["batch"]) for r in data["rows"]] == [("bert-base", 2)]
    assert result.stdout.count("bert-base ") == 1  # one row, printed by the first process


def test_cli_model_bench_distributed_needs_torchrun():
    result = subprocess.run([sys.executable, "-m", "fusedlayers", "bench", "--model", "gpt2",
                             "--distributed"], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    assert result.returncode == 2 and "launch with torchrun" in result.stderr


@pytest.mark.parametrize("variant", mem.VARIANTS)
def test_memory_bench_counts_what_each_layer_saves(variant):
    """Saved bytes of a GELU block and a relu*0.5 block, T tokens of width d (hidden h = 4d),
    float32, against what each layer keeps for backward (README, "Memory"): LayerNorm its input
    (its output with memory_efficient=True, which fc1 keeps anyway) + mean and rstd; fc1 its input;
    GELU (or LinearGELU) the pre-activation; relu * 0.5 unfused relu's output, fused a 1-bit mask;
    fc2 its input; the loss (square) the stack's output."""
    t, d = 64, 16
    h = 4 * d
    model = mem.mlp_stack(d, variant, blocks=2)
    inputs = {"input": torch.randn(t, d, requires_grad=True)}
    saved_mb, peak_mb = mem.measure(model, inputs, torch.device("cpu"))
    norm = (0 if variant == mem.VARIANTS[2] else t * d) + 2 * t
    gelu_block = norm + t * d + t * h + t * h
    relu_saves = t * h if variant == "unfused" else (t * h + 31) // 32  # int32 words
    relu_block = norm + t * d + relu_saves + t * h
    assert saved_mb * 2**20 == 4 * (gelu_block + relu_block + t * d)
    assert peak_mb is None


def test_memory_bench_causal_lm_keeps_no_logits():
    """The tiny llama-lm (vocabulary 1000, 8 x 32 tokens) on its own loss: the unfused model
    saves its float32 logits for the loss's backward (its log-softmax output among them), the
    fused one never makes them."""
    rows = mem.run("cpu", ("llama-lm",), log=lambda line: None)
    saved = {r.variant: r.saved_mb for r in rows}
    logits_mb = 8 * 32 * 1000 * 4 / 2**20
    assert saved["unfused"] - saved["fused"] >= logits_mb, saved


def test_cli_memory_bench_writes_json(tmp_path):
    out = tmp_path / "memory.json"
    assert main.bench(["--memory", "--device", "cpu", "--memory-models", "mlp",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == list(mem.VARIANTS)
    assert rows[1]["saved_mb"] < rows[0]["saved_mb"] and rows[2]["saved_mb"] < rows[1]["saved_mb"]


def test_jax_rows_time_fused_against_xla():
    pytest.importorskip("jax")
    from fusedlayers.bench import jax_ops
    rows, ceilings = jax_ops.run(("float32",), quick=True, reps=1, op_names=("rms_norm",),
                                 iters=1, rounds=2)
    assert {(r.pass_, r.impl) for r in rows} == {("fwd", "jax-fused"), ("fwd", "jax-xla"),
                                                 ("fwd", "jax-copy"), ("fwd+bwd", "jax-fused"),
                                                 ("fwd+bwd", "jax-xla")}
    assert all(r.ms > 0 and r.unit == "GB/s" and len(r.rounds_ms) == 2 for r in rows)
    assert ceilings["copy_gbs"] > 0
