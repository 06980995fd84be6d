"""`python -m fusedlayers bench` on the CPU: rows for the chosen ops, JSON output, bad options."""

import json
import subprocess
import sys

import pytest

from fusedlayers import bench


def test_run_reports_each_pass_and_impl_of_the_chosen_ops():
    rows, ceilings = bench.run("cpu", ("float32",), quick=True, compile=False, reps=2,
                               op_names=("relu_scale", "layer_norm"))
    assert {r.op for r in rows} == {"relu_scale", "layer_norm"}
    assert {(r.pass_, r.impl) for r in rows} == {("fwd", "fused"), ("fwd", "eager"),
                                                 ("fwd", "copy"), ("fwd+bwd", "fused"),
                                                 ("fwd+bwd", "eager")}
    assert ceilings["copy_gbs"] > 0
    for r in rows:
        assert r.ms > 0 and r.unit == "GB/s"
        assert r.pct_of_peak == pytest.approx(100 * r.rate / ceilings["copy_gbs"])


def test_run_rejects_unknown_ops():
    with pytest.raises(ValueError, match="layernorm"):
        bench.run("cpu", op_names=("layernorm",))


def test_cli_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "fusedlayers", "bench", "--device", "cpu", "--quick",
                    "--no-compile", "--reps", "2", "--dtypes", "float32", "--ops", "linear_gelu",
                    "--json", str(out)], check=True, capture_output=True)
    data = json.loads(out.read_text())
    assert {r["op"] for r in data["rows"]} == {"linear_gelu"}
    assert all(r["unit"] == "TFLOP/s" and r["ms"] > 0 for r in data["rows"])
