"""fusedlayers.jax.linear_cross_entropy against the float64 reference (torch's F.linear and
F.cross_entropy, the same as fusedlayers.torch's tests use) over several chunks, for every
reduction and option set, gradients included; against fusedlayers.torch (the same csrc pass);
check_grads; jit; rows sharded over two CPU devices (dW summed, nothing gathered); errors."""

import numpy as np
import pytest
import torch

from _helpers import LCE_OPTIONS, lce_problem, lce_torch_reference, rel_err, run_python

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from fusedlayers.jax import linear_cross_entropy  # noqa: E402

@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    with jax.default_device(jax.devices("cpu")[0]):
        yield
    jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", LCE_OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(reduction, options, bias, x64, seed):
    x, w, b, t = lce_problem(4500, 13, 41, bias, options.get("ignore_index", -100), seed)
    args = [jnp.asarray(a) for a in (x, w) + ((b,) if bias else ())]

    def loss_fn(*args):
        return linear_cross_entropy(args[0], args[1], jnp.asarray(t),
                                    linear_bias=args[2] if bias else None,
                                    reduction=reduction, **options)
    loss, vjp = jax.vjp(loss_fn, *args)
    dy = np.random.default_rng(seed).random(np.shape(loss)) + 0.5
    want, grads_want = lce_torch_reference(x, w, b, t, reduction, dy, options)
    assert loss.dtype == jnp.float64 and loss.shape == want.shape
    assert rel_err(torch.tensor(np.asarray(loss)), torch.tensor(want)) <= 1e-12
    for got, ref in zip(vjp(jnp.asarray(dy)), grads_want):
        assert rel_err(torch.tensor(np.asarray(got)), torch.tensor(ref)) <= 1e-11


def test_check_grads_and_jit(x64):
    from jax.test_util import check_grads
    x, w, b, t = lce_problem(9, 5, 11, True)
    for reduction in ("mean", "none"):
        fn = jax.jit(lambda x, w, b, reduction=reduction: linear_cross_entropy(
            x, w, jnp.asarray(t), linear_bias=b, reduction=reduction, label_smoothing=0.1,
            softcap=2.5, z_loss=1e-2))
        check_grads(fn, [jnp.asarray(a) for a in (x, w, b)], order=1, modes=("rev",),
                    atol=1e-6, rtol=1e-6, eps=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_bits_as_torch_float32_and_close_in_bfloat16(dtype):
    x, w, b, t = lce_problem(300, 32, 200, True)
    jx, jw, jb = (jnp.asarray(a, dtype) for a in (x, w, b))
    loss, grads = jax.value_and_grad(
        lambda x, w, b: linear_cross_entropy(x, w, jnp.asarray(t, jnp.int32), linear_bias=b,
                                             num_items_in_batch=400), argnums=(0, 1, 2))(jx, jw, jb)
    tdt = getattr(torch, dtype)
    tx, tw, tb = (torch.tensor(np.asarray(a, np.float32)).to(tdt).requires_grad_()
                  for a in (jx, jw, jb))
    from fusedlayers.torch import linear_cross_entropy as torch_lce
    tl = torch_lce(tx, tw, torch.tensor(t), linear_bias=tb, num_items_in_batch=400)
    tgrads = torch.autograd.grad(tl, (tx, tw, tb))
    tol = 1e-6 if dtype == "float32" else 2e-2  # XLA's dot and ATen's GEMM sum differently
    assert rel_err(torch.tensor(float(loss)), tl.double().detach()) <= tol
    for g, tg in zip(grads, tgrads):
        assert rel_err(torch.tensor(np.asarray(g, np.float32)), tg.float()) <= tol * 10



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", LCE_OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_runs_csrc_loop_on_cublaslt(reduction, options, dtype, seed):
    """On CUDA the op is one custom call of csrc's chunk loop on cuBLASLt (two chunks here):
    it gives torch's CUDA op (the same loop on ATen's GEMMs) and, in float32, the float64
    reference."""
    from fusedlayers.torch import linear_cross_entropy as torch_lce
    x, w, b, t = lce_problem(5000, 24, 41, True, options.get("ignore_index", -100), seed)
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(jnp.asarray(a, dtype), gpu) for a in (x, w, b)]
    target = jax.device_put(jnp.asarray(t, jnp.int32), gpu)
    dy = np.random.default_rng(seed).random(t.shape if reduction == "none" else ()) + 0.5

    def loss_and_grads(*args):
        loss, vjp = jax.vjp(lambda x, w, b: linear_cross_entropy(
            x, w, target, linear_bias=b, reduction=reduction, loss_dtype=jnp.float32,
            **options), *args)
        return loss, vjp(jnp.asarray(dy, jnp.float32))
    run = jax.jit(loss_and_grads)
    program = run.lower(*args).compile().as_text()
    assert "fusedlayers_linear_cross_entropy_gemm" in program
    assert "fusedlayers_linear_cross_entropy_chunk" not in program
    loss, grads = run(*args)

    targs = [torch.tensor(np.asarray(a, np.float32), device="cuda").to(getattr(torch, dtype))
             .requires_grad_() for a in args]
    tl = torch_lce(targs[0], targs[1], torch.tensor(t, device="cuda"), linear_bias=targs[2],
                   reduction=reduction, loss_dtype=torch.float32, **options)
    tgrads = torch.autograd.grad(tl, targs, torch.tensor(dy, dtype=torch.float32, device="cuda"))
    tol = 1e-5 if dtype == "float32" else 2e-2  # cuBLASLt's and ATen's GEMMs sum differently
    assert rel_err(torch.tensor(np.asarray(loss)), tl.detach().cpu()) <= tol
    for g, tg in zip(grads, tgrads):
        assert g.dtype == jnp.dtype(dtype)
        assert rel_err(torch.tensor(np.asarray(g, np.float32)), tg.float().cpu()) <= tol * 10
    if dtype == "float32":
        want, grads_want = lce_torch_reference(*(np.asarray(a, np.float64) for a in args), t,
                                               reduction, dy, options)
        assert rel_err(torch.tensor(np.asarray(loss, np.float64)), torch.tensor(want)) <= 1e-5
        for g, ref in zip(grads, grads_want):
            assert rel_err(torch.tensor(np.asarray(g, np.float64)), torch.tensor(ref)) <= 1e-5


def test_errors():
    x, w, b, t = (jnp.asarray(a, jnp.float32) if a is not None and i < 3 else a
                  for i, a in enumerate(lce_problem(6, 4, 7, True)))
    t = jnp.asarray(t)
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, none"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match=r"linear_weight must be \(vocab, 4\)"):
        jax.jit(lambda x, w: linear_cross_entropy(x, w, t))(x, w[:, :3])
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        linear_cross_entropy(x, w, t, label_smoothing=2.0)
    with pytest.raises(TypeError, match="linear_weight must have input's dtype float32"):
        linear_cross_entropy(x, w.astype(jnp.bfloat16), t)
    with pytest.raises(TypeError, match="target must be an integer array"):
        linear_cross_entropy(x, w, t.astype(jnp.float32))
    with pytest.raises(ValueError, match="target must have input's leading shape"):
        linear_cross_entropy(x, w, t[:5])
    cpu = jax.devices("cpu")[0]  # on CUDA its row's loss is NaN instead
    with pytest.raises(Exception, match=r"target must be in \[0, 7\) or ignore_index, got 70"):
        jax.block_until_ready(linear_cross_entropy(*jax.device_put((x, w, t.at[5].set(70)), cpu)))


SHARDED = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fusedlayers.jax import linear_cross_entropy
g = np.random.default_rng(0)
x = jnp.asarray(g.normal(size=(2600, 16)), jnp.float32)
w = jnp.asarray(g.normal(size=(50, 16)) / 4, jnp.float32)
t = jnp.asarray(g.integers(0, 50, 2600), jnp.int32)
fn = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, t, reduction="sum"),
                                argnums=(0, 1)))
want = fn(x, w)
if len(jax.devices()) < 2:
    print("skip: fewer than two devices")
    raise SystemExit
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("rows",))
xs = jax.device_put(x, NamedSharding(mesh, P("rows")))
ts = jax.device_put(t, NamedSharding(mesh, P("rows")))
fs = jax.jit(jax.value_and_grad(lambda x, w, t: linear_cross_entropy(x, w, t, reduction="sum"),
                                argnums=(0, 1)))
got = fs(xs, w, ts)
hlo = fs.lower(xs, w, ts).compile().as_text()
for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert err < 1e-5, err
print("gathers", hlo.count("all-gather"), "sums", hlo.count("all-reduce"))
"""


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_rows_sharded_over_two_devices(platform):
    out = run_python(SHARDED, {"JAX_PLATFORMS": platform})
    if out.startswith("skip"):
        pytest.skip(f"needs two JAX {platform} devices")
    gathers, sums = (int(v) for v in out.split()[1::2])
    assert sums >= 1  # dW (and the loss) summed across the devices
    assert gathers == 0, out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_dtype_float32_is_the_float32_loss(reduction, seed):
    x, w, _, t = lce_problem(300, 32, 1000, False, seed=seed)
    xb, wb, tj = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(t)
    got = linear_cross_entropy(xb, wb, tj, reduction=reduction, loss_dtype=jnp.float32)
    default = linear_cross_entropy(xb, wb, tj, reduction=reduction)
    assert got.dtype == jnp.float32 and default.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(default), np.asarray(got.astype(jnp.bfloat16)))
    # the loss of the op's bfloat16 logits in float64 (a bfloat16 loss is up to 2^-8 off)
    logits = jnp.dot(xb, wb.T, preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)
    want = torch.nn.functional.cross_entropy(torch.tensor(np.asarray(logits, np.float64)),
                                             torch.tensor(t), reduction=reduction)
    assert rel_err(torch.tensor(np.asarray(got, np.float64)), want) <= 1e-4
    with pytest.raises(TypeError, match="loss_dtype must be None or a floating dtype"):
        linear_cross_entropy(xb, wb, tj, loss_dtype=jnp.int32)
