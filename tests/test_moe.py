"""The mixture-of-experts ops and experts function: moe_permute / moe_unpermute against stock
torch (the route bitwise: it is integer work; the rows against float64), gradients (gradcheck,
opcheck, tf.test.compute_gradient, jax check_grads), the same bits in torch, TensorFlow and JAX
and on two runs, every framework's argument errors, routing edge cases (an expert no token
reaches, every token on one expert, top-1, expert-parallel sentinels, no tokens), moe_experts
against the expert-by-expert loop, under autocast and in passes over its weights, and the Keras
and Flax layers (fuse() on transformers' MoE models: test_fuse_moe.py)."""

import importlib

import numpy as np
import pytest
import torch

import fusedlayers as fl
from _helpers import assert_calibrated, rel_err, run_python, tf_device

tmoe = {n: importlib.import_module(f"fusedlayers.torch.{n}")
        for n in ("moe_permute", "moe_unpermute", "moe_experts")}
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
# (tokens, hidden, num_experts, top_k, routing): odd sizes, no multiple of anything
SHAPES = [(13, 7, 5, 3, "random"), (1, 8, 1, 1, "random"), (29, 16, 6, 2, "one_expert"),
          (17, 9, 8, 1, "random"), (21, 24, 7, 4, "sentinels"), (0, 8, 3, 2, "random"),
          (33, 40, 9, 3, "unreached")]


def routing(rng, tokens, num_experts, top_k, kind, dtype=torch.int64):
    """top_k_index of one kind: distinct random experts per token; every token's slots on
    expert 0 ("one_expert"); some ids outside [0, num_experts) ("sentinels"); expert
    num_experts - 1 never chosen ("unreached")."""
    pick = num_experts - 1 if kind == "unreached" else num_experts
    idx = np.argsort(rng.uniform(0, 1, (tokens, max(pick, top_k))), 1)[:, :top_k] % max(pick, 1)
    if kind == "one_expert":
        idx[:] = 0
    if kind == "sentinels":
        idx[rng.uniform(0, 1, idx.shape) < 0.3] = num_experts + 2
        idx[0, 0] = -1
    return torch.from_numpy(idx).to(dtype)


def unpermute64(ys, idx, rows, w, num_experts):
    return tmoe["moe_unpermute"].reference(ys.double(), idx, rows,
                                           None if w is None else w.double(), num_experts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_permute_matches_stock_torch(shape, index_dtype, device, rng):
    tokens, hidden, experts, k, kind = shape
    idx = routing(rng, tokens, experts, k, kind, index_dtype).to(device)
    x = torch.from_numpy(rng.normal((tokens, 2 * hidden))).float().to(device)[:, ::2]  # strided
    xs, rows, offsets = fl.moe_permute(x, idx, experts)
    want = tmoe["moe_permute"].reference(x, idx, experts)
    assert rows.dtype == offsets.dtype == torch.int32
    for got, ref in zip((xs, rows, offsets), want):
        assert torch.equal(got, ref)  # a copy and integer work: exact
    valid = ((idx >= 0) & (idx < experts)).sum().item()
    assert (offsets[-1].item() if experts else 0) == valid
    assert torch.count_nonzero(xs[valid:]) == 0  # pairs that reach no expert: zero rows, last


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("weights", ["same", "float32", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_unpermute_against_float64(shape, dtype, weights, device, rng):
    if device == "cuda" and dtype == "float64":
        pytest.skip("float64 runs on the CPU kernels")
    tokens, hidden, experts, k, kind = shape
    dt = DTYPES[dtype]
    idx = routing(rng, tokens, experts, k, kind).to(device)
    _, rows, _ = fl.moe_permute(torch.zeros(tokens, hidden, device=device), idx, experts)
    ys = torch.from_numpy(rng.normal((tokens * k, hidden))).to(dt).to(device).requires_grad_()
    w = None if weights == "none" else torch.from_numpy(rng.uniform(0, 1, (tokens, k))).to(
        dt if weights == "same" else torch.float32).to(device).requires_grad_()
    out = fl.moe_unpermute(ys, idx, rows, w, experts)
    dout = torch.from_numpy(rng.normal((tokens, hidden))).to(dt).to(device)
    leaves = [ys] if w is None else [ys, w]
    got = torch.autograd.grad(out, leaves, dout) if out.numel() else [torch.zeros_like(t)
                                                                      for t in leaves]
    ys64, w64 = ys.detach().double().requires_grad_(), None if w is None else \
        w.detach().double().requires_grad_()
    ref = unpermute64(ys64, idx, rows, w64, experts)
    leaves64 = [ys64] if w is None else [ys64, w64]
    want = torch.autograd.grad(ref, leaves64, dout.double()) if ref.numel() else \
        [torch.zeros_like(t) for t in leaves64]
    base = tmoe["moe_unpermute"].reference(ys.detach(), idx, rows,
                                           None if w is None else w.detach(), experts)
    assert out.dtype == dt and (w is None or got[1].dtype == w.dtype)
    # one rounding of a float32 sum: no worse than the unfused layer (which rounds once too)
    assert_calibrated(rel_err(out.cpu(), ref.cpu()), rel_err(base.cpu(), ref.cpu()),
                      f"out {dtype}", dtype=dtype, numel=out.numel(), floor=1e-6, rng=rng)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    # the weights' gradient sums dout * ys over the hidden dim, which may cancel: judged against
    # the size of its terms, the same sum of their magnitudes
    scales = [None]
    if w is not None and ref.numel():
        w_abs = w64.detach().requires_grad_()
        scales.append(torch.autograd.grad(unpermute64(ys64.detach().abs(), idx, rows, w_abs,
                                                      experts), w_abs, dout.double().abs())[0])
    for g, r, scale in zip(got, want, scales):  # each gradient rounded once to its own dtype
        assert rel_err(g.cpu(), r.cpu(), None if scale is None else scale.cpu()) <= tol[g.dtype]


@pytest.mark.parametrize("shape", [(6, 5, 4, 3, "sentinels"), (9, 4, 3, 2, "random")],
                         ids=lambda s: "-".join(map(str, s)))
def test_gradcheck_and_opcheck(shape, rng):
    tokens, hidden, experts, k, kind = shape
    idx = routing(rng, tokens, experts, k, kind)
    x = torch.from_numpy(rng.normal((tokens, hidden))).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: fl.moe_permute(x, idx, experts)[0], [x])
    _, rows, _ = fl.moe_permute(x.detach(), idx, experts)
    ys = torch.from_numpy(rng.normal((tokens * k, hidden))).requires_grad_()
    w = torch.from_numpy(rng.uniform(0, 1, (tokens, k))).requires_grad_()
    assert torch.autograd.gradcheck(lambda ys, w: fl.moe_unpermute(ys, idx, rows, w, experts),
                                    [ys, w])
    assert torch.autograd.gradcheck(lambda ys: fl.moe_unpermute(ys, idx, rows, None, experts),
                                    [ys])
    ops = torch.ops.fusedlayers
    dout = torch.randn(tokens, hidden, dtype=torch.float64)
    for op, args in ((ops.moe_permute, (x, idx, experts)),
                     (ops.moe_permute_backward, (ys.detach(), idx, rows, experts)),
                     (ops.moe_unpermute, (ys, idx, rows, w, experts)),
                     (ops.moe_unpermute_backward, (dout, ys.detach(), idx, rows, w.detach(),
                                                   experts))):
        torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor",
                                                            "test_autograd_registration"))


@pytest.mark.parametrize("device", DEVICES)
def test_two_runs_give_the_same_bits(device, rng):
    tokens, hidden, experts, k = 257, 64, 16, 4
    idx = routing(rng, tokens, experts, k, "random").to(device)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(tokens, k, device=device, requires_grad=True)

    def run():
        xs, rows, _ = fl.moe_permute(x, idx, experts)
        out = fl.moe_unpermute(xs * 1.5, idx, rows, w, experts)
        return (out, *torch.autograd.grad(out.float().square().sum(), [x, w]))
    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_errors_name_the_argument():
    x, idx = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"fusedlayers\.moe_permute: top_k_index must be int32 "
                                        r"or int64, got Float"):
        fl.moe_permute(x, idx.float(), 3)
    with pytest.raises(ValueError, match=r"moe_permute: num_experts must be in \[1, 8192\], got 0"):
        fl.moe_permute(x, idx, 0)
    with pytest.raises(ValueError, match=r"moe_permute: x must have top_k_index's 4 tokens, got "
                                         r"shape \[5, 8\]"):
        fl.moe_permute(torch.randn(5, 8), idx, 3)
    xs, rows, _ = fl.moe_permute(x, idx, 3)
    with pytest.raises(TypeError, match=r"moe_unpermute: row_index must be int32, got Long"):
        fl.moe_unpermute(xs, idx, rows.long(), None, 3)
    with pytest.raises(ValueError, match=r"moe_unpermute: ys must have tokens \* top_k = 8 rows"):
        fl.moe_unpermute(xs[:7], idx, rows, None, 3)
    with pytest.raises(TypeError, match=r"moe_unpermute: top_k_weights must be float32 or "
                                        r"bfloat16, got float16"):
        fl.moe_unpermute(xs.bfloat16(), idx, rows, torch.ones(4, 2, dtype=torch.half), 3)
    with pytest.raises(ValueError, match=r"moe_unpermute: top_k_weights must have top_k_index's "
                                         r"shape \[4, 2\], got \[4, 3\]"):
        fl.moe_unpermute(xs, idx, rows, torch.ones(4, 3), 3)


# ---------------------------------------------------------------- TensorFlow and JAX

def _other_frameworks(rng):
    tokens, hidden, experts, k = 19, 12, 5, 3
    idx = routing(rng, tokens, experts, k, "sentinels", torch.int32)
    x = torch.from_numpy(rng.normal((tokens, hidden))).float()
    w = torch.from_numpy(rng.uniform(0, 1, (tokens, k))).float()
    dout = torch.from_numpy(rng.normal((tokens, hidden))).float()
    return idx, x, w, dout, experts


def _torch_results(idx, x, w, dout, experts):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    xs, rows, offsets = fl.moe_permute(x, idx, experts)
    out = fl.moe_unpermute(xs * 2.0, idx, rows, w, experts)
    dx, dw = torch.autograd.grad(out, [x, w], dout)
    return [t.detach().cpu().numpy() for t in (xs, rows, offsets, out, dx, dw)]


def test_tensorflow_gives_torch_bits_and_gradients(rng):
    tf = pytest.importorskip("tensorflow")
    idx, x, w, dout, experts = _other_frameworks(rng)
    tx, tw = tf.constant(x.numpy()), tf.constant(w.numpy())
    ti = tf.constant(idx.numpy())
    with tf.GradientTape() as tape:
        tape.watch([tx, tw])
        xs, rows, offsets = fl.moe_permute(tx, ti, experts)
        out = fl.moe_unpermute(xs * 2.0, ti, rows, tw, experts)
    dx, dw = tape.gradient(out, [tx, tw], output_gradients=tf.constant(dout.numpy()))
    for got, want in zip((xs, rows, offsets, out, dx, dw), _torch_results(idx, x, w, dout,
                                                                           experts)):
        np.testing.assert_array_equal(got.numpy(), want)
    x64 = tf.constant(x.numpy().astype(np.float64)[:6])
    i6 = ti[:6]
    _, rows6, _ = fl.moe_permute(x64, i6, experts)
    err = tf.test.compute_gradient(lambda a, b: fl.moe_unpermute(
        fl.moe_permute(a, i6, experts)[0], i6, rows6, b, experts),
        [x64, tf.constant(w.numpy().astype(np.float64)[:6])])
    for theoretical, numerical in zip(*err):
        np.testing.assert_allclose(theoretical, numerical, atol=1e-8)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"fusedlayers\.moe_permute: num_experts must be in \[1, 8192\]"):
        fl.moe_permute(tx, ti, 9000)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"moe_unpermute: row_index must be int32, got int64"):
        fl.moe_unpermute(xs, ti, tf.cast(rows, tf.int64), None, experts)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensorflow_gpu_gives_torch_cuda_bits(rng):
    """On TensorFlow's GPU the MoE glue runs torch's CUDA kernels, eagerly (the route on the host,
    where TF keeps the indices: backends/tensorflow/moe.cc) and under XLA (custom calls): the
    same bits, forward and gradients, the rows on the GPU; moe_experts on TensorFlow's GPU
    against float64."""
    tf = pytest.importorskip("tensorflow")
    gpu = tf_device("cuda")
    idx, x, w, dout, experts = _other_frameworks(rng)
    want = _torch_results(*(t.cuda() for t in (idx, x, w, dout)), experts)

    def glue(tx, ti, tw, tdout):
        with tf.GradientTape() as tape:
            tape.watch([tx, tw])
            xs, rows, offsets = fl.moe_permute(tx, ti, experts)
            out = fl.moe_unpermute(xs * 2.0, ti, rows, tw, experts)
        return (xs, rows, offsets, out, *tape.gradient(out, [tx, tw], output_gradients=tdout))

    for mode, fn in (("eager", glue), ("xla", tf.function(glue, jit_compile=True))):
        with tf.device(gpu):
            got = fn(*(tf.constant(t.numpy()) for t in (x, idx, w, dout)))
        for name, g, ref in zip(("xs", "rows", "offsets", "out", "dx", "dw"), got, want):
            # eagerly TF keeps the int32 rows and offsets of a GPU op in host memory
            if mode == "xla" or name not in ("rows", "offsets"):
                assert g.device.endswith("GPU:0"), (mode, name, g.device)
            np.testing.assert_array_equal(g.numpy(), ref, err_msg=f"{mode} {name}")

    args, kw = _experts_problem(rng, torch.float32, transposed=True, bias=True)
    want = tmoe["moe_experts"].reference(*[a.double() if a.is_floating_point() else a
                                           for a in args],
                                         **{k: v.double() if isinstance(v, torch.Tensor) else v
                                            for k, v in kw.items()})
    with tf.device(gpu):
        got = fl.moe_experts(*[tf.constant(a.numpy()) for a in args],
                             **{k: tf.constant(v.numpy()) if isinstance(v, torch.Tensor) else v
                                for k, v in kw.items()})
    assert got.device.endswith("GPU:0")
    assert rel_err(torch.from_numpy(got.numpy()), want) <= 1e-5


def test_jax_gives_torch_bits_and_gradients(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.test_util import check_grads

    import fusedlayers.jax as flj  # check_grads passes NumPy arrays, which fl would not take
    idx, x, w, dout, experts = _other_frameworks(rng)
    cpu = jax.devices("cpu")[0]
    ji = jax.device_put(idx.numpy(), cpu)

    def block(x, w):
        xs, rows, offsets = flj.moe_permute(x, ji, experts)
        return xs, rows, offsets, flj.moe_unpermute(xs * 2.0, ji, rows, w, experts)
    with jax.default_device(cpu):  # the CPU kernels, as torch's above
        jx, jw = jax.device_put(x.numpy(), cpu), jax.device_put(w.numpy(), cpu)
        xs, rows, offsets, out = jax.jit(block)(jx, jw)
        dx, dw = jax.grad(lambda x, w: jnp.sum(block(x, w)[3] * jnp.asarray(dout.numpy())),
                          argnums=(0, 1))(jx, jw)
    for got, want in zip((xs, rows, offsets, out, dx, dw), _torch_results(idx, x, w, dout,
                                                                           experts)):
        np.testing.assert_array_equal(np.asarray(got), want)
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        x64, w64 = (jax.device_put(t.numpy().astype(np.float64), cpu) for t in (x, w))
        check_grads(lambda a, b: block(a, b)[3], (x64, w64), order=1, modes=("rev",))
    with pytest.raises(TypeError, match=r"moe_permute: top_k_index must be int32 or int64"):
        fl.moe_permute(jx, ji.astype(jnp.float32), experts)
    with pytest.raises(ValueError, match=r"moe_unpermute: ys must have tokens \* top_k = 57 "
                                         r"rows"):
        fl.moe_unpermute(xs[:5], ji, rows, None, experts)


# ---------------------------------------------------------------- moe_experts

def _experts_problem(rng, dtype=torch.float64, transposed=False, bias=False):
    tokens, hidden, ffn, experts, k = 23, 12, 10, 6, 3
    idx = routing(rng, tokens, experts, k, "unreached")
    t = lambda *s: torch.from_numpy(rng.normal(s, scale=0.4)).to(dtype)  # noqa: E731
    w1 = t(experts, hidden, 2 * ffn) if transposed else t(experts, 2 * ffn, hidden)
    w2 = t(experts, ffn, hidden) if transposed else t(experts, hidden, ffn)
    args = [t(tokens, hidden), idx, torch.from_numpy(rng.uniform(0, 1, (tokens, k))).to(dtype),
            w1, w2]
    kw = dict(transposed=transposed)
    if bias:
        kw.update(gate_up_proj_bias=t(experts, 2 * ffn), down_proj_bias=t(experts, hidden))
    return args, kw


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["plain", "transposed-bias"])
def test_experts_against_the_expert_loop(activation, layout, rng):
    args, kw = _experts_problem(rng, transposed=layout != "plain", bias=layout != "plain")
    leaves = [a for a in args if a.is_floating_point()] + [v for v in kw.values()
                                                           if isinstance(v, torch.Tensor)]
    for t in leaves:
        t.requires_grad_()
    got = fl.moe_experts(*args, activation=activation, **kw)
    want = tmoe["moe_experts"].reference(*args, activation=activation, **kw)
    dout = torch.randn_like(want)
    for g, r in zip(torch.autograd.grad(got, leaves, dout),
                    torch.autograd.grad(want, leaves, dout)):
        assert rel_err(g, r) <= 1e-12
    assert rel_err(got, want) <= 1e-12


def test_experts_gate_function_and_bfloat16(rng):
    args, kw = _experts_problem(rng, torch.float32)
    gate = lambda h: torch.sigmoid(h[:, 0::2]) * h[:, 1::2]  # noqa: E731  an interleaved gate
    want = tmoe["moe_experts"].reference(*[a.double() if a.is_floating_point() else a
                                           for a in args], gate=gate)
    got = fl.moe_experts(*args, gate=gate)
    assert rel_err(got, want) <= 1e-5
    half = [a.bfloat16() if a.is_floating_point() else a for a in args]
    got16 = fl.moe_experts(*half)
    base16 = tmoe["moe_experts"].reference(*half)
    want64 = tmoe["moe_experts"].reference(*[a.double() if a.is_floating_point() else a
                                             for a in half])
    assert got16.dtype == torch.bfloat16
    assert rel_err(got16, want64) <= 2 * rel_err(base16, want64) + 4e-3
    with pytest.raises(ValueError, match=r"moe_experts: activation must be one of silu, gelu, "
                                         r"gelu_tanh, got 'relu'"):
        fl.moe_experts(*args, activation="relu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden", [16, 13])  # rows 16-byte aligned (grouped_mm) or not (loop)
def test_experts_float32_against_float64(device, hidden, rng):
    tokens, ffn, experts, k = 37, 8, 5, 2
    t = lambda *s: torch.from_numpy(rng.normal(s, scale=0.4)).to(device)  # noqa: E731
    args = [t(tokens, hidden), routing(rng, tokens, experts, k, "unreached").to(device),
            t(tokens, k).abs(), t(experts, 2 * ffn, hidden), t(experts, hidden, ffn)]
    want = tmoe["moe_experts"].reference(*args)
    got = fl.moe_experts(*[a.float() if a.is_floating_point() else a for a in args])
    assert got.dtype == torch.float32 and rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_experts_under_autocast_run_in_its_dtype(device, rng):
    """Under autocast the experts' GEMMs run as autocast runs a matmul: float32 hidden states and
    weights cast once to its dtype (the same bits as moe_experts on the cast operands, not those
    of float32 GEMMs), the result in the hidden states' dtype and the weights' gradients in
    theirs."""
    args, kw = _experts_problem(rng, torch.float32, transposed=True, bias=True)
    args = [a.to(device) for a in args]
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    leaves = [args[0], args[3], args[4], kw["gate_up_proj_bias"], kw["down_proj_bias"]]
    for t in leaves:
        t.requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        got = fl.moe_experts(*args, **kw)
    cast = [a.detach().bfloat16().requires_grad_() if a.is_floating_point() and i != 2 else a
            for i, a in enumerate(args)]
    kw16 = {k: v.detach().bfloat16().requires_grad_() if isinstance(v, torch.Tensor) else v
            for k, v in kw.items()}
    want = fl.moe_experts(*cast, **kw16)
    assert got.dtype == torch.float32 and torch.equal(got, want.float())
    assert not torch.equal(got, fl.moe_experts(*[a.detach() for a in args], **kw))
    dout = torch.randn_like(got)
    grads = torch.autograd.grad(got, leaves, dout)
    leaves16 = [cast[0], cast[3], cast[4], kw16["gate_up_proj_bias"], kw16["down_proj_bias"]]
    for g, r in zip(grads, torch.autograd.grad(want, leaves16, dout.bfloat16())):
        assert g.dtype == torch.float32 and torch.equal(g, r.float())


@pytest.mark.parametrize("hidden", [16, 13])  # grouped_mm; the loop (rows not 16-byte aligned)
def test_experts_backward_passes_over_the_weights_are_bounded(hidden, rng):
    """The float32 backward on the CPU allocates a bounded multiple of the weights' and
    activations' bytes, however many experts there are, and clears no tensor per expert (an
    expert's slice of the weights indexed in autograd would write a zero tensor of all of them
    in its backward)."""
    from torch.profiler import ProfilerActivity, profile
    tokens, ffn, experts, k = 64, 10, 16, 2
    x = torch.randn(tokens, hidden, requires_grad=True)
    w1 = torch.randn(experts, 2 * ffn, hidden, requires_grad=True)
    w2 = torch.randn(experts, hidden, ffn, requires_grad=True)
    idx = routing(rng, tokens, experts, k, "random")
    y = fl.moe_experts(x, idx, torch.rand(tokens, k), w1, w2)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y.backward(torch.randn_like(y))
    events = prof.events()
    allocated = sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0)
    weights = (w1.numel() + w2.numel()) * 4
    activations = tokens * k * (2 * hidden + 3 * ffn) * 4
    assert allocated <= 4 * (weights + activations), (allocated, weights, activations)
    clears = sum(e.name in ("aten::zero_", "aten::fill_") for e in events)
    assert clears <= 8, clears


def test_experts_in_tensorflow_and_jax(rng):
    tf = pytest.importorskip("tensorflow")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    args, kw = _experts_problem(rng, torch.float32, transposed=True, bias=True)
    want = tmoe["moe_experts"].reference(*[a.double() if a.is_floating_point() else a
                                           for a in args],
                                         **{k: v.double() if isinstance(v, torch.Tensor) else v
                                            for k, v in kw.items()})
    conv = lambda f: ([f(a.numpy()) for a in args],  # noqa: E731
                      {k: f(v.numpy()) if isinstance(v, torch.Tensor) else v
                       for k, v in kw.items()})
    for name, (a, k) in (("tf", conv(tf.constant)), ("jax", conv(jnp.asarray))):
        got = fl.moe_experts(*a, **k)
        assert rel_err(torch.from_numpy(np.asarray(got)), want) <= 1e-5, name


# ---------------------------------------------------------------- Keras and Flax

@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_keras_layer_on_every_backend(backend):
    pytest.importorskip("keras")
    pytest.importorskip({"torch": "torch", "jax": "jax", "tensorflow": "tensorflow"}[backend])
    code = """
import importlib, numpy as np, keras, torch
from fusedlayers.keras import MoEExperts
rng = np.random.default_rng(3)
x = rng.standard_normal((9, 16)).astype("float32")
idx = np.argsort(rng.random((9, 5)), 1)[:, :2].astype("int32")
w = rng.random((9, 2)).astype("float32")
layer = MoEExperts(5, 8, activation="gelu_tanh")
y = keras.ops.convert_to_numpy(layer(x, idx, w))
ref = importlib.import_module("fusedlayers.torch.moe_experts").reference(
    torch.tensor(x, dtype=torch.float64), torch.tensor(idx).long(),
    torch.tensor(w, dtype=torch.float64),
    *(torch.tensor(keras.ops.convert_to_numpy(v), dtype=torch.float64)
      for v in (layer.gate_up_proj, layer.down_proj)), activation="gelu_tanh")
assert np.abs(y - ref.numpy()).max() <= 1e-5 * np.abs(ref.numpy()).max(), backend
again = MoEExperts.from_config(layer.get_config())
assert again.get_config() == layer.get_config()
print("ok")
"""
    out = run_python(code.replace("backend)", f"{backend!r})"), {"KERAS_BACKEND": backend})
    assert out.strip().endswith("ok")


def test_flax_module(rng):
    pytest.importorskip("flax")
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from fusedlayers.flax import MoEExperts
    x = rng.normal((9, 16)).astype(np.float32)
    idx = np.argsort(rng.uniform(0, 1, (9, 5)), 1)[:, :2].astype(np.int32)
    w = rng.uniform(0, 1, (9, 2)).astype(np.float32)
    m = MoEExperts(16, 8, 5, rngs=nnx.Rngs(0))
    with jax.default_device(jax.devices("cpu")[0]):  # float32 dots (a GPU's default is TF32)
        y = m(x, idx, w)
    ref = tmoe["moe_experts"].reference(
        torch.from_numpy(x).double(), torch.from_numpy(idx).long(), torch.from_numpy(w).double(),
        torch.from_numpy(np.array(m.gate_up_proj.value)).double(),
        torch.from_numpy(np.array(m.down_proj.value)).double())
    assert rel_err(torch.from_numpy(np.array(y)), ref) <= 1e-5
    grads = nnx.grad(lambda m: jnp.sum(m(x, idx, w) ** 2))(m)
    assert jax.tree.leaves(grads) and all(jnp.isfinite(g).all() for g in jax.tree.leaves(grads))
    with pytest.raises(ValueError, match="MoEExperts: num_experts must be a positive integer"):
        MoEExperts(16, 8, 0, rngs=nnx.Rngs(0))
