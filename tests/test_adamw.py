"""fusedlayers.torch.AdamW against torch.optim.AdamW (float64, every option), against a float64
reference with the stored values rounded to their dtypes (16-bit parameters, master weights,
16-bit moments), state_dict round trips both ways, AMP's grad_scale / found_inf, gradient-norm
clipping, the errors, CUDA graph capture, FSDP2 on two processes and HSDP on four (gloo, and NCCL
where there are as many GPUs)."""

import copy
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _helpers import DEVICES, rel_err
from fusedlayers.torch import AdamW

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(7, 3), (10001,), (0,), (5,), (3, 1, 129)]


def make_params(shapes, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
                               .to(device)) for s in shapes]


def set_grads(groups, seed, skip=()):
    """The same random gradients on each list of `groups` (params i in skip get none)."""
    g = torch.Generator().manual_seed(seed)
    for i, ps in enumerate(zip(*groups)):
        grad = torch.randn(ps[0].shape, generator=g, dtype=torch.float64)
        for p in ps:
            p.grad = None if i in skip else grad.to(p.dtype).to(p.device, copy=True)


OPTIONS = [dict(), dict(weight_decay=0.0), dict(amsgrad=True), dict(maximize=True),
           dict(betas=(0.5, 0.9), eps=1e-3, weight_decay=0.3), dict(lr="tensor")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_matches_torch_adamw_float64(device, options, seed):
    ours_p = make_params(SHAPES, torch.float64, device, seed)
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    kw = dict(options)
    lr = kw.pop("lr", None)
    lr_value = torch.tensor(3e-2)  # float32, as the kernels read a learning rate tensor
    ours = AdamW(ours_p, lr=lr_value.to(device) if lr else 3e-2, **kw)
    ref = torch.optim.AdamW(ref_p, lr=lr_value.item() if lr else 3e-2, foreach=False, **kw)
    for step in range(4):
        set_grads([ours_p, ref_p], seed + step, skip={3} if step == 1 else ())
        ours.step()
        ref.step()
    for p, r in zip(ours_p, ref_p, strict=True):
        assert rel_err(p, r) < 1e-13
    for p, r in zip(ours_p, ref_p):
        for key, value in ref.state[r].items():
            assert rel_err(ours.state[p][key].cpu().double(), value.cpu().double()) < 1e-13, key
    assert ours.state[ours_p[3]]["step"].item() == 3  # skipped once: no gradient


@pytest.mark.parametrize("device", DEVICES)
def test_clipping_matches_clip_grad_norm(device, seed):
    ours_p = make_params(SHAPES, torch.float64, device, seed)
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = AdamW(ours_p, lr=1e-2, max_grad_norm=0.5)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)
    for step in range(3):
        set_grads([ours_p, ref_p], seed + step)
        norm = torch.nn.utils.clip_grad_norm_(ref_p, 0.5)
        ours.step()
        ref.step()
        assert rel_err(ours.grad_norm.cpu(), norm.cpu()) < 1e-13
    for p, r in zip(ours_p, ref_p):
        assert rel_err(p, r) < 1e-13


def test_ten_thousand_tiny_tensors(seed):
    shapes = [(1 + i % 5,) for i in range(10000)]
    ours_p = make_params(shapes, torch.float64, "cpu", seed)
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours, ref = AdamW(ours_p, lr=1e-2), torch.optim.AdamW(ref_p, lr=1e-2, foreach=True)
    for step in range(2):
        set_grads([ours_p, ref_p], seed + step)
        ours.step()
        ref.step()
    assert rel_err(torch.cat(ours_p), torch.cat(ref_p)) < 1e-13


def reference_step(w, m, v, g, step, lr, beta1, beta2, eps, wd, param_dtype, moment_dtype):
    """The unfused update in float64 with every stored value rounded to its dtype: (parameter as
    stored, w in float64 (the master), m, v)."""
    w = w * (1 - lr * wd)
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps
    w = w - lr / (1 - beta1 ** step) * m / denom
    round_m = lambda t: t.to(moment_dtype).double()  # noqa: E731
    return w.to(param_dtype), w, round_m(m), round_m(v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype,moment_dtype,master", [
    (torch.bfloat16, torch.float32, True), (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True), (torch.bfloat16, None, False),
    (torch.float16, None, False), (torch.bfloat16, torch.float32, False),
    (torch.float32, torch.bfloat16, False), (torch.float32, torch.float16, False)])
def test_low_precision_against_float64_reference(device, param_dtype, moment_dtype, master,
                                                 seed):
    """Each step against the float64 update of the same stored values, rounded once: the
    parameter within half an ulp of its dtype (plus float32 math), the master and moments within
    their dtype's rounding."""
    params = make_params(SHAPES, param_dtype, device, seed)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, master_weights=master,
                moment_dtype=moment_dtype)
    lr, (beta1, beta2), eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.1
    mdt = moment_dtype or (torch.float32 if master else param_dtype)
    masters = [p.detach().double() for p in params]
    moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in masters]
    eps_p, eps_m = torch.finfo(param_dtype).eps, torch.finfo(mdt).eps
    for step in range(1, 4):
        set_grads([params], seed + step)
        grads = [p.grad.double() for p in params]
        opt.step()
        for i, p in enumerate(params):
            w_in = masters[i] if master else p.detach().double() * 0 + masters[i]
            want_p, want_w, want_m, want_v = reference_step(
                w_in, *moments[i], grads[i], step, lr, beta1, beta2, eps, wd, param_dtype, mdt)
            state = opt.state[p]
            assert state["exp_avg"].dtype == mdt
            assert rel_err(state["exp_avg"], want_m) <= 2 * eps_m + 1e-6
            assert rel_err(state["exp_avg_sq"], want_v) <= 2 * eps_m + 1e-6
            if master:
                assert state["master_param"].dtype == torch.float32
                assert rel_err(state["master_param"], want_w) < 1e-6
                assert torch.equal(p.detach(), state["master_param"].to(param_dtype))
            assert rel_err(p, want_p) <= eps_p
            # the next step starts from what is stored, as the kernel does
            masters[i] = state["master_param"].double() if master else p.detach().double()
            moments[i] = (state["exp_avg"].double(), state["exp_avg_sq"].double())


def test_masters_match_float32_adamw(seed):
    """bf16 parameters with masters train as a float32 AdamW would, then rounded."""
    p32 = make_params(SHAPES, torch.float32, "cpu", seed)
    p16 = [torch.nn.Parameter(p.detach().clone()) for p in p32]
    model = torch.nn.ParameterList(p16)
    ours = AdamW.with_master_weights(model, torch.bfloat16, lr=1e-2)
    ref = torch.optim.AdamW(p32, lr=1e-2, foreach=False)
    for step in range(3):
        set_grads([p32], seed + step)
        for a, b in zip(p16, p32):
            a.grad = b.grad.to(torch.bfloat16)
            b.grad = a.grad.float()  # the gradient both see: bf16's
        ours.step()
        ref.step()
    for a, b in zip(p16, p32):
        assert a.dtype == torch.bfloat16
        master = ours.state[a]["master_param"]
        assert rel_err(master, b) < 1e-6
        # the parameter is its master rounded (a master ulps from the float32 run's may round to
        # the bfloat16 value next to that run's rounded value)
        assert torch.equal(a.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_masters_for_16_bit_parameters_only(device, seed):
    """A group of bf16 and float32 parameters under master_weights: masters for the bf16 ones,
    each updated as by an optimizer of its own."""
    mixed = make_params([(7, 3)], torch.bfloat16, device, seed) + \
        make_params([(9,)], torch.float32, device, seed + 1)
    alone = [torch.nn.Parameter(p.detach().clone()) for p in mixed]
    ours = AdamW(mixed, lr=1e-2, master_weights=True)
    refs = [AdamW([p], lr=1e-2, master_weights=True) for p in alone]
    for step in range(2):
        set_grads([mixed, alone], seed + step)
        ours.step()
        for r in refs:
            r.step()
    assert "master_param" in ours.state[mixed[0]] and "master_param" not in ours.state[mixed[1]]
    for p, q in zip(mixed, alone):
        assert torch.equal(p, q)


def test_state_dict_round_trips_with_torch(seed):
    mk = lambda: make_params(SHAPES, torch.float64, "cpu", seed)  # noqa: E731
    a_p, b_p, c_p = mk(), mk(), mk()
    ours = AdamW(a_p, lr=1e-2, amsgrad=True)
    ref = torch.optim.AdamW(b_p, lr=1e-2, amsgrad=True, foreach=False)
    for step in range(2):
        set_grads([a_p, b_p], seed + step)
        ours.step()
        ref.step()
    # ours -> torch, torch -> ours: both then continue as the other would have
    torch_from_ours = torch.optim.AdamW(copy.deepcopy(a_p), lr=0.5)
    torch_from_ours.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert torch_from_ours.param_groups[0]["lr"] == 1e-2
    assert torch_from_ours.param_groups[0]["decoupled_weight_decay"] is True
    ours_from_torch = AdamW(c_p, lr=0.5)
    with torch.no_grad():
        for p, q in zip(c_p, b_p):
            p.copy_(q)
    ours_from_torch.load_state_dict(copy.deepcopy(ref.state_dict()))
    t_p = torch_from_ours.param_groups[0]["params"]
    set_grads([a_p, b_p, c_p, t_p], seed + 9)
    for opt in (ours, ref, torch_from_ours, ours_from_torch):
        opt.step()
    for a, b, c, t in zip(a_p, b_p, c_p, t_p):
        assert rel_err(a, b) < 1e-13 and rel_err(c, b) < 1e-13 and rel_err(t, b) < 1e-13


def test_master_state_dict_round_trip(seed):
    model = torch.nn.ParameterList(make_params(SHAPES, torch.float32, "cpu", seed))
    opt = AdamW.with_master_weights(model, lr=1e-2)
    set_grads([list(model)], seed)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    other = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in model])
    loaded = AdamW(other.parameters(), lr=1e-2, master_weights=True)
    loaded.load_state_dict(sd)
    for p, q in zip(model, other):
        for key in ("master_param", "exp_avg", "exp_avg_sq", "step"):
            assert loaded.state[q][key].dtype == torch.float32, key
            assert torch.equal(loaded.state[q][key], opt.state[p][key]), key
    # a float32 torch AdamW takes the same checkpoint, masters unused
    torch.optim.AdamW(copy.deepcopy(list(other)), lr=1e-2).load_state_dict(sd)


def test_grad_scale_and_found_inf(seed):
    a_p = make_params(SHAPES, torch.float64, "cpu", seed)
    b_p = [torch.nn.Parameter(p.detach().clone()) for p in a_p]
    a, b = AdamW(a_p, lr=1e-2), AdamW(b_p, lr=1e-2)
    set_grads([a_p, b_p], seed)
    for p in a_p:
        p.grad *= 1024
    a.grad_scale, a.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
    a.step()
    b.step()
    for p, q in zip(a_p, b_p):
        assert rel_err(p, q) < 1e-13
    before = [p.detach().clone() for p in a_p]
    a.found_inf = torch.tensor(1.0)
    a.step()
    assert all(torch.equal(p, q) for p, q in zip(a_p, before))
    assert a.state[a_p[0]]["step"].item() == 1


def test_under_grad_scaler(seed):
    """GradScaler drives the optimizer through grad_scale / found_inf (no unscale_ pass)."""
    model = torch.nn.Linear(8, 4).double()
    ref_model = copy.deepcopy(model)
    opt, ref = AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref_model.parameters(),
                                                                      lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    for _ in range(2):
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref_model(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert rel_err(p, q) < 1e-12


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(lr=-1.0), ValueError, "lr must be in"),
    (dict(betas=(1.0, 0.9)), ValueError, "beta1 must be in"),
    (dict(betas=(0.9, -0.1)), ValueError, "beta2 must be in"),
    (dict(eps=-1e-8), ValueError, "eps must be in"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay must be in"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm must be in"),
    (dict(moment_dtype=torch.int32), TypeError, "moment_dtype must be"),
])
def test_bad_hyperparameters_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match="fusedlayers.adamw: " + match):
        AdamW([torch.nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize("case,error,match", [
    ("grad dtype", TypeError, r"grad of params\[0\] must be float32, got float64"),
    ("moment dtype", TypeError, r"exp_avg of params\[0\] must be the parameter's dtype float16 "
                                r"or float32, got bfloat16"),
    ("master of float32", TypeError, r"master of params\[0\] is for float16 and bfloat16"),
    ("strides", ValueError, r"grads\[0\] must be dense with the strides of params\[0\]"),
    ("integer", TypeError, r"params\[0\] must be float32, float64, float16 or bfloat16"),
])
def test_bad_tensors(case, error, match):
    p = torch.nn.Parameter(torch.randn(4, 6))
    kw = {}
    if case == "grad dtype":
        p.grad_dtype = None  # let a gradient of another dtype be set
        p.grad = torch.randn(4, 6, dtype=torch.float64)
    elif case == "moment dtype":
        p = torch.nn.Parameter(torch.randn(4, 6).half())
        p.grad = torch.randn_like(p)
        kw = dict(moment_dtype=torch.bfloat16)
    elif case == "master of float32":
        p.grad = torch.randn_like(p)
        opt = AdamW([p])
        opt._init_state(p, opt.param_groups[0])["master_param"] = torch.zeros(4, 6)
        with pytest.raises(error, match=match):
            opt.step()
        return
    elif case == "strides":
        p.grad = torch.randn(6, 4).t()
    else:
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)
        p.grad = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(error, match="fusedlayers.adamw: " + match):
        AdamW([p], **kw).step()


def test_permuted_dense_parameters(seed):
    """A parameter stored transposed (dense, other strides) with its state alike."""
    base = make_params([(6, 5)], torch.float64, "cpu", seed)[0]
    p = torch.nn.Parameter(base.detach().t())  # strides (1, 5)
    q = torch.nn.Parameter(base.detach().t().contiguous())
    ours, ref = AdamW([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for step in range(2):
        set_grads([[p], [q]], seed + step)
        p.grad = p.grad.t().contiguous().t()  # the parameter's strides
        ours.step()
        ref.step()
    assert rel_err(p, q) < 1e-13


def test_opcheck(seed):
    ps = make_params([(3, 5), (7,)], torch.float32, "cpu", seed)
    args = ([p.detach() for p in ps], [torch.randn_like(p) for p in ps],
            [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], [], [],
            [torch.zeros(()) for _ in ps], 1e-2, None, 0.9, 0.999, 1e-8, 0.01, False, False,
            None, None, None, 0.0)
    torch.library.opcheck(torch.ops.fusedlayers.adamw.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.fusedlayers.adamw_grad_sumsq.default,
                          (args[1], args[1][0]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("master", [False, True])
def test_cuda_graph_capture(master, seed):
    """A captured step replayed with a new learning rate and new gradients equals eager steps."""
    dtype = torch.bfloat16 if master else torch.float32
    a_p = make_params(SHAPES, dtype, "cuda", seed)
    b_p = [torch.nn.Parameter(p.detach().clone()) for p in a_p]
    lr_a, lr_b = torch.tensor(1e-2, device="cuda"), torch.tensor(1e-2, device="cuda")
    kw = dict(master_weights=master, max_grad_norm=1.0, capturable=True)
    a, b = AdamW(a_p, lr=lr_a, **kw), AdamW(b_p, lr=lr_b, **kw)
    set_grads([a_p, b_p], seed)
    a.step()  # warm-up: the state exists before capture
    b.step()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        a.step()
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(1, 4):
        set_grads([b_p], seed + step)
        for p, q in zip(a_p, b_p):
            if p.numel():
                p.grad.copy_(q.grad)
        lr_a.fill_(1e-2 / step)
        lr_b.fill_(1e-2 / step)
        graph.replay()
        b.step()
    torch.cuda.synchronize()
    for p, q in zip(a_p, b_p):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["step"], b.state[q]["step"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype, seed):
    """The CUDA kernels (vector and one-element paths: odd sizes, a 2-byte offset) give the CPU's
    values within one rounding a step (the devices' sqrt and division may round the update
    differently, and each step's parameter carries the last's difference)."""
    shapes = SHAPES + [(8192 * 3 + 5,)]
    cpu = make_params(shapes, dtype, "cpu", seed)
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    offset = torch.nn.Parameter(torch.randn(1001, dtype=dtype, device="cuda")[1:])
    cpu.append(torch.nn.Parameter(offset.detach().cpu()))
    gpu.append(offset)
    master = dtype != torch.float32
    a, b = AdamW(cpu, lr=1e-2, master_weights=master), AdamW(gpu, lr=1e-2, master_weights=master)
    steps = 3
    for step in range(steps):
        set_grads([cpu, gpu], seed + step)
        a.step()
        b.step()
    for p, q in zip(cpu, gpu):
        assert rel_err(q.cpu(), p) <= steps * torch.finfo(dtype).eps


FSDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from fusedlayers.torch import AdamW
    device_type = sys.argv[3]  # cpu (gloo, also where CUDA is present) or cuda (NCCL)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", dist.get_rank())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(),
                                   torch.nn.Linear(33, 5)).to(device)
    ours, ref = model(), model()
    # FSDP2 over (2,), HSDP over (2, 2): replicated over the first dim, sharded over the second
    shape = tuple(map(int, sys.argv[2].split("x")))
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    for m in (ours, ref):
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    a = AdamW(ours.parameters(), lr=1e-2, max_grad_norm=0.1)
    b = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    for _ in range(3):
        ours(x).square().mean().backward()
        ref(x).square().mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        a.step(); b.step(); a.zero_grad(); b.zero_grad()
        assert abs(a.grad_norm.item() - norm.full_tensor().item()) < 1e-5 * norm.full_tensor().item()
    for p, q in zip(ours.parameters(), ref.parameters()):
        err = (p.full_tensor() - q.full_tensor()).abs().max().item()
        assert err < 1e-6, err
    sd = a.state_dict()
    assert all(type(s["exp_avg"]).__name__ == "DTensor" for s in sd["state"].values())
    open(os.path.join(sys.argv[1], f"ok{dist.get_rank()}"), "w").close()
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mesh", ["2", "2x2"], ids=["fsdp2", "hsdp"])
def test_fsdp2_processes(mesh, device, tmp_path):
    """max_grad_norm's norm and the update under FSDP2 (two processes) and HSDP (four: two
    replicas of two shards, where the sums of squares add over the shards only) as
    torch.optim.AdamW's after clip_grad_norm_ on the same sharded model."""
    script = tmp_path / "fsdp_adamw.py"
    script.write_text(FSDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    procs = math.prod(map(int, mesh.split("x")))
    if device == "cuda" and torch.cuda.device_count() < procs:
        pytest.skip(f"needs {procs} CUDA devices")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", str(procs), str(script), str(tmp_path), mesh,
                             device],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert all((tmp_path / f"ok{r}").exists() for r in range(procs))  # every rank got there
