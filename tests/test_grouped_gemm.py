"""grouped_gemm: each pass (fprop, dgrad, wgrad) against a float64 loop of per-group GEMMs on
fresh seeds and odd sizes (empty groups, groups of one row, rows past the last group, both
weight layouts, strided inputs), calibrated half-precision bounds, gradients (gradcheck,
opcheck, tf.test.compute_gradient, jax check_grads), the same bits in torch, TensorFlow and JAX,
every framework's argument errors, JAX under jit, a sharded jit and shard_map, and on CUDA the
Hopper kernels and the tiled kernel against the loop and torch's grouped_mm (edges: groups
smaller than a tile, unaligned data, graph capture)."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fusedlayers as fl
from _helpers import assert_calibrated, rel_err, tf_device

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
# (group sizes, tail rows past the last group, k, n): empty groups, one-row groups, odd widths
SHAPES = [((3, 0, 5, 1), 2, 7, 5), ((1,), 0, 4, 3), ((0, 0, 9), 0, 13, 6),
          ((4, 11, 0, 2, 7), 3, 16, 24), ((0, 0), 4, 5, 3), ((17, 1, 30), 0, 24, 40)]


def offsets_of(sizes, device="cpu") -> torch.Tensor:
    return torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=device)


def problem(rng, sizes, tail, k, n, transposed, dtype, device):
    """x (rows, k) strided, weight in its layout, dy (rows, n) and offsets."""
    rows = sum(sizes) + tail
    groups = len(sizes)
    x = torch.from_numpy(rng.normal((rows, 2 * k))).to(device, dtype)[:, ::2]
    shape = (groups, k, n) if transposed else (groups, n, k)
    weight = torch.from_numpy(rng.normal(shape) / k ** 0.5).to(device, dtype)
    dy = torch.from_numpy(rng.normal((rows, n))).to(device, dtype)
    return x, weight, dy, offsets_of(sizes, device)


def loop64(x, weight, offsets, transposed):
    """The per-group GEMMs in float64, zeros past the last group."""
    x, w = x.double(), weight.double()
    y = x.new_zeros(x.shape[0], w.shape[2] if transposed else w.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        wg = w[g] if transposed else w[g].t()
        y[start:end] = x[start:end] @ wg
        start = end
    return y


def grads64(x, weight, dy, offsets, transposed):
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    y = loop64(x64, w64, offsets, transposed)
    dx, dw = torch.autograd.grad(y, (x64, w64), dy.double())
    return y.detach(), dx, dw


def run(x, weight, dy, offsets, transposed):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    y = fl.grouped_gemm(x, weight, offsets, transposed=transposed)
    dx, dw = torch.autograd.grad(y, (x, weight), dy)
    return y.detach(), dx, dw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s[0])) + f"_{s[1:]}")
def test_matches_float64_loop(shape, dtype, transposed, device, rng):
    """Forward, dx and dweight against float64; half precision within twice the error of the
    same loop in that dtype (torch's own GEMMs), plus an ulp."""
    sizes, tail, k, n = shape
    t = DTYPES[dtype]
    x, w, dy, offsets = problem(rng, sizes, tail, k, n, transposed, t, device)
    ours = run(x, w, dy, offsets, transposed)
    want = grads64(x, w, dy, offsets, transposed)
    if t in (torch.float32, torch.float64):
        for got, ref, name in zip(ours, want, ("y", "dx", "dweight")):
            assert got.dtype == t and got.shape == ref.shape, name
            assert rel_err(got.cpu(), ref.cpu()) <= (1e-6 if t == torch.float32 else 1e-13), name
        return
    x32, w32, dy32 = (v.float() for v in (x, w, dy))
    base = [v.to(t) for v in grads64(x32, w32, dy32, offsets, transposed)]  # rounded once
    for got, ref, b, name in zip(ours, want, base, ("y", "dx", "dweight")):
        assert got.dtype == t, name
        assert_calibrated(rel_err(got.cpu(), ref.cpu()), rel_err(b.cpu(), ref.cpu()), name,
                          dtype=t, numel=max(ref.numel(), 1))


def test_empty_groups_and_tail_are_zeros(rng):
    """A group with no rows gets a zero weight gradient, rows past the last group zero y and dx,
    whatever the output buffers held before."""
    x, w, dy, offsets = problem(rng, (0, 4, 0), 3, 8, 8, False, torch.float32, "cpu")
    y, dx, dw = run(x, w, dy, offsets, False)
    assert torch.all(y[4:] == 0) and torch.all(dx[4:] == 0)
    assert torch.all(dw[0] == 0) and torch.all(dw[2] == 0) and torch.any(dw[1] != 0)


# Offsets that are not row ends of 6 rows: decreasing, negative, past x's rows; the message
# names the first bad one.
BAD_OFFSETS = [([4, 2], "offsets[1] = 2"), ([-3, 6], "offsets[0] = -3"),
               ([3, 100], "offsets[1] = 100")]


@pytest.mark.parametrize("framework", ["torch", "tensorflow", "jax"])
@pytest.mark.parametrize("offsets,bad", BAD_OFFSETS, ids=["decreasing", "negative", "past"])
def test_invalid_host_offsets_raise(framework, offsets, bad, rng):
    """Where the offsets are in host memory (the CPU passes, forward and backward) they are
    checked: csrc's error naming offsets, in every framework (JAX: raised from the compiled
    computation, which carries csrc's message)."""
    x, w, dy, _ = problem(rng, (3, 3), 0, 4, 5, False, torch.float32, "cpu")
    offsets = np.array(offsets, np.int32)
    message = rf"grouped_gemm(_backward)?: offsets must be the groups' row ends.*{re.escape(bad)}"
    if framework == "torch":
        with pytest.raises(ValueError, match=message):
            fl.grouped_gemm(x, w, torch.from_numpy(offsets))
        with pytest.raises(ValueError, match=message):
            torch.ops.fusedlayers.grouped_gemm_backward(dy, x, w, torch.from_numpy(offsets),
                                                        False, [True, True])
    elif framework == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        xt, wt = tf.constant(x.numpy()), tf.constant(w.numpy())
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            fl.grouped_gemm(xt, wt, tf.constant(offsets))
        with pytest.raises(tf.errors.InvalidArgumentError, match=message), tf.GradientTape() as tape:
            tape.watch(xt)
            tape.gradient(fl.grouped_gemm(xt, wt, tf.constant(offsets)), xt)
    else:
        import jax
        import jax.numpy as jnp
        args = jax.device_put((jnp.asarray(x.numpy()), jnp.asarray(w.numpy()),
                               jnp.asarray(offsets)), jax.devices("cpu")[0])
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            jax.block_until_ready(fl.grouped_gemm(*args))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_invalid_offsets_stay_in_bounds(rng):
    """On the device the offsets are read by the kernels, where invalid ones are clamped: no
    error, nothing outside y written (the values are unspecified, the shapes and the tail's
    zeros hold)."""
    x, w, _, _ = problem(rng, (3, 3), 0, 4, 5, False, torch.float32, "cuda")
    y = fl.grouped_gemm(x, w, torch.tensor([4, 2], dtype=torch.int32, device="cuda"))
    assert y.shape == (6, 5) and torch.all(y[4:] == 0)
    y = fl.grouped_gemm(x, w, torch.tensor([-3, 100], dtype=torch.int32, device="cuda"))
    assert torch.allclose(y.cpu(), loop64(x, w, torch.tensor([0, 6]), False).float().cpu(),
                          atol=1e-5)


def test_gradcheck_and_opcheck(rng):
    x, w, _, offsets = problem(rng, (2, 0, 3), 1, 3, 4, True, torch.float64, "cpu")
    x, w = x.contiguous().requires_grad_(), w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fl.grouped_gemm(a, b, offsets, transposed=True),
                                    (x, w))
    torch.library.opcheck(torch.ops.fusedlayers.grouped_gemm.default, (x, w, offsets, True))
    dy = torch.randn(x.shape[0], 4, dtype=torch.float64)
    torch.library.opcheck(torch.ops.fusedlayers.grouped_gemm_backward.default,
                          (dy, x.detach(), w.detach(), offsets, True, [True, True]))


def test_only_the_wanted_gradient(rng):
    """A frozen weight: the backward writes dx alone (output_mask), and the result is the same."""
    x, w, dy, offsets = problem(rng, (3, 2), 1, 6, 5, False, torch.float32, "cpu")
    x = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(fl.grouped_gemm(x, w, offsets), (x,), dy)
    assert torch.equal(dx, run(x, w, dy, offsets, False)[1])


def test_matches_torch_grouped_mm(rng):
    """The op as a drop-in for F.grouped_mm over moe_permute's rows (float32 on the CPU)."""
    if not hasattr(F, "grouped_mm"):
        pytest.skip("torch without grouped_mm")
    x, w, _, offsets = problem(rng, (5, 0, 3, 8), 0, 16, 8, False, torch.float32, "cpu")
    x = x.contiguous()
    assert rel_err(fl.grouped_gemm(x, w, offsets), F.grouped_mm(x, w.transpose(1, 2),
                                                                offs=offsets)) < 1e-6


def test_same_bits_in_torch_tensorflow_and_jax(rng):
    """One csrc kernel: the three frameworks give the same bits, forward and gradients."""
    import jax
    tf = pytest.importorskip("tensorflow")

    import fusedlayers.jax as flj

    x, w, dy, offsets = problem(rng, (4, 0, 7), 2, 9, 6, False, torch.bfloat16, "cpu")
    x = x.contiguous()
    want = [v.float().numpy() for v in run(x, w, dy, offsets, False)]
    np_args = [v.float().numpy() for v in (x, w, dy)]

    xt, wt = (tf.cast(tf.constant(v), tf.bfloat16) for v in np_args[:2])
    with tf.GradientTape() as tape:
        tape.watch([xt, wt])
        y = fl.grouped_gemm(xt, wt, tf.constant(offsets.numpy()))
    dxt, dwt = tape.gradient(y, [xt, wt], output_gradients=tf.cast(np_args[2], tf.bfloat16))
    for got, ref in zip((y, dxt, dwt), want):
        np.testing.assert_array_equal(tf.cast(got, tf.float32).numpy(), ref)

    xj, wj, dyj = (jax.numpy.asarray(v, jax.numpy.bfloat16) for v in np_args)
    yj, vjp = jax.vjp(lambda a, b: flj.grouped_gemm(a, b, offsets.numpy()), xj, wj)
    for got, ref in zip((yj, *vjp(dyj)), want):
        np.testing.assert_array_equal(np.asarray(got, np.float32), ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [*SHAPES, ((40, 0, 7, 24), 3, 64, 48)],
                         ids=lambda s: "-".join(map(str, s[0])) + f"_{s[1:]}")
def test_tensorflow_gpu_gives_torch_cuda_bits(shape, dtype, rng):
    """TensorFlow's GPU kernel runs torch's CUDA grouped GEMM (checked against the float64 loop
    above): the same bits, forward and gradients, on the Hopper path (aligned bfloat16) and the
    tiled one."""
    tf = pytest.importorskip("tensorflow")
    gpu = tf_device("cuda")
    sizes, tail, k, n = shape
    x, w, dy, offsets = problem(rng, sizes, tail, k, n, False, DTYPES[dtype], "cuda")
    want = [v.float().cpu().numpy() for v in run(x, w, dy, offsets, False)]
    with tf.device(gpu):
        xt, wt, dyt = (tf.cast(tf.constant(v.float().cpu().numpy()), dtype) for v in (x, w, dy))
        with tf.GradientTape() as tape:
            tape.watch([xt, wt])
            y = fl.grouped_gemm(xt, wt, tf.constant(offsets.cpu().numpy()))
        dxt, dwt = tape.gradient(y, [xt, wt], output_gradients=dyt)
    for got, ref, name in zip((y, dxt, dwt), want, ("y", "dx", "dweight")):
        assert got.device.endswith("GPU:0"), (name, got.device)
        np.testing.assert_array_equal(tf.cast(got, tf.float32).numpy(), ref, err_msg=name)


def test_tensorflow_gradient():
    tf = pytest.importorskip("tensorflow")

    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(7, 3)))
    w = tf.constant(rng.normal(size=(3, 3, 4)))
    offsets = tf.constant([2, 2, 6], tf.int32)
    theoretical, numerical = tf.test.compute_gradient(
        lambda a, b: fl.grouped_gemm(a, b, offsets, transposed=True), [x, w])
    for t, nmr in zip(theoretical, numerical):
        np.testing.assert_allclose(t, nmr, rtol=1e-6, atol=1e-6)


def test_jax_check_grads_jit_and_sharding():
    """check_grads in float64; under jit; with rows sharded over two devices (XLA hands the call
    whole arrays) and in shard_map with replicated weights (each device its own rows, the
    weight's gradient summed), all equal to the unsharded call."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax.test_util import check_grads

    import fusedlayers.jax as flj

    cpu = jax.devices("cpu")
    with jax.enable_x64(True), jax.default_device(cpu[0]):
        rng = np.random.default_rng(2)
        x = jnp.asarray(rng.normal(size=(9, 4)))
        w = jnp.asarray(rng.normal(size=(3, 5, 4)))
        offsets = jnp.asarray([3, 3, 8], jnp.int32)
        check_grads(lambda a, b: flj.grouped_gemm(a, b, offsets), (x, w), order=1,
                    modes=("rev",))
    rng = np.random.default_rng(3)
    x, w, offsets = jax.device_put((jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
                                    jnp.asarray(rng.normal(size=(3, 16, 8)), jnp.float32),
                                    jnp.asarray([2, 5, 7], jnp.int32)), cpu[0])

    def loss(a, b, off):
        return (flj.grouped_gemm(a, b, off, transposed=True) ** 2).sum()
    want = jax.value_and_grad(loss, (0, 1))(x, w, offsets)
    got = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w, offsets)
    mesh = jax.make_mesh((2,), ("data",), devices=cpu[:2])
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    w, offsets = jax.device_put((w, offsets), NamedSharding(mesh, P()))  # replicated
    sharded = jax.jit(jax.value_and_grad(loss, (0, 1)))(xs, w, offsets)
    # data parallel: each device its 4 rows with offsets of its own, the same replicated weight
    # (whose gradient autodiff sums over the devices)
    local = jnp.asarray([[2, 4, 4], [0, 1, 3]], jnp.int32)

    def step(a, b, off):
        value, grads = jax.value_and_grad(loss, (0, 1))(a, b, off[0])
        return jax.lax.psum(value, "data"), grads[0], grads[1]
    mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                   out_specs=(P(), P("data"), P())))(
        xs, w, jax.device_put(local, NamedSharding(mesh, P("data"))))
    for other in (got, sharded, (mapped[0], mapped[1:])):
        np.testing.assert_allclose(other[0], want[0], rtol=1e-6)
        for a, b in zip(other[1], want[1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("framework", ["torch", "tensorflow", "jax"])
def test_errors(framework):
    """Every framework gives csrc's message: a weight of another dtype, a weight whose k is not
    x's, int64 offsets, offsets of another length."""
    x = np.zeros((4, 3), np.float32)
    cases = [(np.zeros((2, 5, 3), np.float64), np.array([1, 4], np.int32), "must have x's dtype"),
             (np.zeros((2, 5, 4), np.float32), np.array([1, 4], np.int32), "must have x's k = 3"),
             (np.zeros((2, 5, 3), np.float32), np.array([1, 4], np.int64),
              "offsets must be int32"),
             (np.zeros((2, 5, 3), np.float32), np.array([4], np.int32),
              "offsets must have shape [2]")]
    for w, offsets, message in cases:
        if framework == "torch":
            call = lambda: fl.grouped_gemm(torch.from_numpy(x), torch.from_numpy(w),  # noqa: E731
                                           torch.from_numpy(offsets))
            errors = (TypeError, ValueError)
        elif framework == "tensorflow":
            tf = pytest.importorskip("tensorflow")
            call = lambda: fl.grouped_gemm(tf.constant(x), tf.constant(w),  # noqa: E731
                                           tf.constant(offsets))
            errors = (tf.errors.InvalidArgumentError,)
        else:
            import jax
            import jax.numpy as jnp
            with jax.enable_x64(True):
                call_args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(offsets))
            call = lambda: fl.grouped_gemm(*call_args)  # noqa: E731
            errors = (TypeError, ValueError)
        with pytest.raises(errors, match=message.replace("[", r"\[")):
            call()


def experts_problem(rng, tokens, hidden, ffn, experts, k):
    """float32 NumPy operands of moe_experts: hidden states, distinct top-k experts per token
    (int32), their weights, gate_up_proj and down_proj scaled to unit-size products."""
    x = rng.normal((tokens, hidden)).astype(np.float32)
    idx = np.argsort(rng.uniform(0, 1, (tokens, experts)), 1)[:, :k].astype(np.int32)
    weights = rng.uniform(0, 1, (tokens, k)).astype(np.float32)
    w1 = (rng.normal((experts, 2 * ffn, hidden)) / hidden ** 0.5).astype(np.float32)
    w2 = (rng.normal((experts, hidden, ffn)) / ffn ** 0.5).astype(np.float32)
    return x, idx, weights, w1, w2


@pytest.mark.parametrize("framework", ["torch", "tensorflow", "jax"])
def test_moe_experts_on_grouped_gemm(framework, rng):
    """moe_experts with gemm="fusedlayers" equals the framework's GEMMs (float32, on the CPU)."""
    x, idx, weights, w1, w2 = experts_problem(rng, 11, 8, 6, 4, 2)
    if framework == "torch":
        args = [torch.from_numpy(v) for v in (x, idx, weights, w1, w2)]
    elif framework == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        args = [tf.constant(v) for v in (x, idx, weights, w1, w2)]
    else:
        import jax
        args = jax.device_put([v for v in (x, idx, weights, w1, w2)], jax.devices("cpu")[0])
    ours = np.asarray(fl.moe_experts(*args, gemm="fusedlayers"))
    theirs = np.asarray(fl.moe_experts(*args, gemm="framework"))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="gemm must be one of"):
        fl.moe_experts(*args, gemm="cutlass")


# ---------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True])
def test_cuda_bfloat16_against_loop_and_grouped_mm(transposed, rng):
    """bfloat16 at an MoE layer's shape (the Hopper kernels on sm90): y, dx and dweight against
    float64 within twice torch's grouped_mm error (or the float32 loop's where grouped_mm is
    absent), the same bits on two runs."""
    experts, k, n = 16, 256, 384
    sizes = (rng.uniform(0, 200, experts)).astype(int)
    sizes[3] = 0
    sizes[5] = 1
    x, w, dy, offsets = problem(rng, tuple(sizes.tolist()), 5, k, n, transposed, torch.bfloat16,
                                "cuda")
    x = x.contiguous()
    ours = run(x, w, dy, offsets, transposed)
    assert all(torch.equal(a, b) for a, b in zip(ours, run(x, w, dy, offsets, transposed)))
    want = grads64(x, w, dy, offsets, transposed)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    yg = F.grouped_mm(xg, wg if transposed else wg.transpose(1, 2), offs=offsets)
    base = [yg.detach(), *torch.autograd.grad(yg, (xg, wg), dy)]
    base[0][int(offsets[-1]):] = 0  # grouped_mm leaves the rows past the end as they were
    base[1][int(offsets[-1]):] = 0
    for got, ref, b, name in zip(ours, want, base, ("y", "dx", "dweight")):
        assert_calibrated(rel_err(got.cpu(), ref.cpu()), rel_err(b.cpu(), ref.cpu()), name,
                          dtype=torch.bfloat16, numel=ref.numel())
    assert torch.all(ours[2][3] == 0)


@cuda
@pytest.mark.cuda
def test_cuda_tiled_paths(rng):
    """The tiled kernel where the Hopper kernels cannot run: widths not multiples of 8, data 2
    bytes off 16-byte alignment, float16, float32: against float64."""
    for dtype, k, n, shift in ((torch.bfloat16, 20, 12, 0), (torch.bfloat16, 64, 64, 1),
                               (torch.float16, 64, 40, 0), (torch.float32, 33, 17, 0)):
        x, w, dy, offsets = problem(rng, (9, 0, 70, 1), 3, k, n, False, dtype, "cuda")
        if shift:
            buf = torch.empty(x.numel() + shift, device="cuda", dtype=dtype)
            x = buf[shift:].view(x.shape).copy_(x)
        ours = run(x, w, dy, offsets, False)
        want = grads64(x, w, dy, offsets, False)
        for got, ref in zip(ours, want):
            assert rel_err(got.cpu(), ref.cpu()) < (1e-5 if dtype == torch.float32 else 1e-2)


@cuda
@pytest.mark.cuda
def test_cuda_graph_capture(rng):
    """No host sync: the forward and backward capture in a CUDA graph and replay with new
    offsets."""
    x, w, dy, offsets = problem(rng, (40, 0, 24), 8, 64, 64, True, torch.bfloat16, "cuda")
    x = x.contiguous()
    static = offsets.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fl.grouped_gemm(x, w, static, transposed=True)
        dx, dw = torch.ops.fusedlayers.grouped_gemm_backward(dy, x, w, static, True,
                                                             [True, True])
    static.copy_(offsets_of((10, 30, 24), "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = run(x, w, dy, static, True)
    for got, ref in zip((y, dx, dw), want):
        assert torch.equal(got, ref)


@cuda
@pytest.mark.cuda
def test_cuda_jax_experts_match_torch(rng):
    """On CUDA JAX's moe_experts runs grouped_gemm (bfloat16): its result equals torch's
    moe_experts with gemm="fusedlayers" within bfloat16 rounding."""
    import jax
    import jax.numpy as jnp

    import fusedlayers.jax as flj

    x, idx, weights, w1, w2 = experts_problem(rng, 64, 128, 64, 8, 2)
    tt = [torch.from_numpy(v).cuda() for v in (x, idx, weights, w1, w2)]
    for i in (0, 3, 4):
        tt[i] = tt[i].bfloat16()
    want = fl.moe_experts(*tt, gemm="fusedlayers").float().cpu().numpy()
    jj = [jnp.asarray(v) for v in (x, idx, weights, w1, w2)]
    for i in (0, 3, 4):
        jj[i] = jj[i].astype(jnp.bfloat16)
    got = jax.jit(lambda *a: flj.moe_experts(*a))(*jj)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
