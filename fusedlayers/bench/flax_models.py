"""`python -m fusedlayers bench --framework jax --model llama-lm|llama-lm-128k|qwen3-moe`, its
Flax NNX rows: the ~1.1B Llama language model of the Keras rows (fusedlayers.bench.keras_models: 16
blocks of width 2048, GQA 32/8 heads of 64 with rotary embeddings, a 5632-wide SwiGLU MLP,
pre-RMSNorm, vocabularies 32000 / 128256, 4 x 2048 tokens) in Flax NNX, bfloat16 computation
with float32 parameters, a training step under `jax.jit`: the mean next-token loss, its
gradient, optax's AdamW.

Unfused: flax.nnx's RMSNorm and Linear layers, the rotation and silu(gate) * up in jnp, the
logits of the head and optax's `softmax_cross_entropy_with_integer_labels` on them (float32).
Fused, the same parameters (one state tree): fusedlayers.flax's RMSNorm, every residual add in
the next norm (AddRMSNorm, across blocks too), RotaryEmbedding, GatedMLP and LinearCrossEntropy.
Attention is `jax.nn.dot_product_attention` in both (cuDNN's on GPUs). One model at a time (two with their
optimizer states do not fit with the unfused logits), `rounds` runs of `steps` steps, median ms
per step (the loss of the last step waited for); the step's XLA temp buffer (activations and
workspace, `memory_analysis` of the compiled step) in MB; the first losses compared.

qwen3-moe: the torch bench's Qwen3-MoE-shaped LM (8 blocks of width 2048, GQA 32/4 heads of
128 with per-head q/k RMSNorm, each block's MLP 128 experts of 768 with top-8 routing, a
151936-word head, 2 x 2048 tokens), bfloat16 parameters (float32 ones with their AdamW state do
not fit 80 GB). Unfused: the router, then the jnp experts block on jax.lax.ragged_dot
(fusedlayers.jax.moe_experts.reference); fused: fusedlayers.flax's MoEExperts (grouped_gemm on
CUDA's Hopper kernels) and the fused norms, rotation and head; a third row, fused with the
experts' GEMMs on ragged_dot (gemm="framework"), parts the GEMMs' share from the rest."""

import statistics
import time

from .table import did_not_run

CONFIGS = {"llama-lm": dict(blocks=16, width=2048, heads=32, kv_heads=8, mlp=5632, vocab=32000,
                            seq=2048),
           "llama-lm-128k": dict(blocks=16, width=2048, heads=32, kv_heads=8, mlp=5632,
                                 vocab=128256, seq=2048),
           "tiny": dict(blocks=2, width=64, heads=4, kv_heads=2, mlp=160, vocab=1000, seq=64)}
MOE_CONFIGS = {"qwen3-moe": dict(blocks=8, width=2048, heads=32, kv_heads=4, head_dim=128,
                                 experts=128, top_k=8, ffn=768, vocab=151936, seq=2048),
               "tiny": dict(blocks=2, width=64, heads=4, kv_heads=2, head_dim=16, experts=4,
                            top_k=2, ffn=32, vocab=1000, seq=64)}


def _rotate(x, dim: int, theta: float):
    """Llama's rotate_half rotation of x (batch, seq, heads, dim) in jnp (the unfused rows)."""
    import jax.numpy as jnp

    inv = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    freq = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv
    angles = jnp.concatenate([freq, freq], -1)[None, :, None]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    return x * cos + jnp.concatenate([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin


def _attention(width: int, heads: int, kv_heads: int, dim: int, theta: float, fused: bool,
               linear: dict, qk_norm=None, linear_cls=None):
    """The models' attention class: GQA projections (linear_cls, default nnx.Linear), per-head
    q/k norms where qk_norm (rngs -> a norm) is given (Qwen3), the rotation (fusedlayers'
    RotaryEmbedding fused, _rotate not), jax.nn.dot_product_attention (cuDNN's on GPUs: XLA's
    keeps every layer's probabilities for the backward)."""
    import jax
    from flax import nnx

    import fusedlayers.flax as flf
    attention = "cudnn" if jax.devices()[0].platform == "gpu" else None
    Linear = linear_cls or nnx.Linear

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = Linear(width, heads * dim, rngs=rngs, **linear)
            self.k_proj = Linear(width, kv_heads * dim, rngs=rngs, **linear)
            self.v_proj = Linear(width, kv_heads * dim, rngs=rngs, **linear)
            self.o_proj = Linear(heads * dim, width, rngs=rngs, **linear)
            if qk_norm is not None:
                self.q_norm, self.k_norm = qk_norm(rngs), qk_norm(rngs)
            self.rotary = flf.RotaryEmbedding(theta) if fused else None

        def __call__(self, x):
            b, s = x.shape[:2]
            q, k, v = (p(x).reshape(b, s, n, dim) for p, n in
                       ((self.q_proj, heads), (self.k_proj, kv_heads), (self.v_proj, kv_heads)))
            if qk_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = (self.rotary(q), self.rotary(k)) if fused else \
                (_rotate(q, dim, theta), _rotate(k, dim, theta))
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
            return self.o_proj(y.reshape(b, s, heads * dim))
    return Attention


def _loss(model, ids, labels, fused: bool):
    """The models' mean next-token loss: pre-norm blocks, the final norm and the head; unfused
    as the residual adds, the logits and optax's loss, fused as each add in the next norm and
    the fused head."""
    import jax.numpy as jnp
    import optax

    h = model.embed(ids)
    if not fused:
        for layer in model.layers:
            h = h + layer.attn(layer.attn_norm(h))
            h = h + layer.mlp(layer.mlp_norm(h))
        y = model.final_norm(h)
        logits = y @ model.head.kernel[...].astype(y.dtype).T
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                               labels).mean()
    layers = list(model.layers)
    y = layers[0].attn_norm(h)
    for i, layer in enumerate(layers):
        y, h = layer.mlp_norm(layer.attn(y), h)
        after = layers[i + 1].attn_norm if i + 1 < len(layers) else model.final_norm
        y, h = after(layer.mlp(y), h)
    return model.head(y, labels)


def build_moe(blocks: int, width: int, heads: int, kv_heads: int, head_dim: int, experts: int,
              top_k: int, ffn: int, vocab: int, seq: int, fused: bool, gemm=None, seed: int = 0):
    """The Qwen3-MoE-shaped model (as build's), bfloat16 parameters; gemm: the fused experts'
    GEMMs (fusedlayers.jax.moe_experts' gemm)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import fusedlayers.flax as flf
    from fusedlayers.jax.moe_experts import reference as experts_reference
    bf16, dim = jnp.bfloat16, head_dim
    linear = dict(use_bias=False, dtype=bf16, param_dtype=bf16)

    def norm(features, first, rngs):
        cls = nnx.RMSNorm if not fused else flf.RMSNorm if first else flf.AddRMSNorm
        return cls(features, epsilon=1e-6, dtype=bf16, param_dtype=bf16, rngs=rngs)

    Attention = _attention(width, heads, kv_heads, dim, 1e6, fused, linear,
                           qk_norm=lambda rngs: norm(dim, True, rngs))

    class MoE(nnx.Module):
        def __init__(self, rngs):
            self.router = nnx.Linear(width, experts, rngs=rngs, **linear)
            self.experts = flf.MoEExperts(width, ffn, experts, dtype=bf16, param_dtype=bf16,
                                          gemm=gemm, rngs=rngs)

        def __call__(self, x):
            shape = x.shape
            x = x.reshape(-1, width)
            probs = jax.nn.softmax(self.router(x).astype(jnp.float32), -1)
            weights, index = jax.lax.top_k(probs, top_k)
            weights = (weights / weights.sum(-1, keepdims=True)).astype(bf16)
            if fused:
                return self.experts(x, index, weights).reshape(shape)
            return experts_reference(x, index, weights, self.experts.gate_up_proj[...],
                                     self.experts.down_proj[...]).reshape(shape)

    class Block(nnx.Module):
        def __init__(self, first, rngs):
            self.attn_norm, self.attn = norm(width, first, rngs), Attention(rngs)
            self.mlp_norm, self.mlp = norm(width, False, rngs), MoE(rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, width, dtype=bf16, param_dtype=bf16, rngs=rngs)
            self.layers = getattr(nnx, "List", list)([Block(i == 0, rngs)
                                                      for i in range(blocks)])
            self.final_norm = norm(width, False, rngs)
            if fused:
                self.head = flf.LinearCrossEntropy(width, vocab, dtype=bf16, param_dtype=bf16,
                                                   rngs=rngs)
            else:
                self.head = nnx.Module()
                self.head.kernel = nnx.Param(nnx.initializers.lecun_normal()(
                    rngs.params(), (vocab, width), bf16))

        def __call__(self, ids, labels):
            return _loss(self, ids, labels, fused)

    return Model(nnx.Rngs(seed))


def build(blocks: int, width: int, heads: int, kv_heads: int, mlp: int, vocab: int, seq: int,
          fused: bool, seed: int = 0, fp8=None):
    """The model (an nnx.Module whose __call__(ids, labels) is the mean loss), its parameters
    drawn from `seed` in the same order fused or not. fp8 (a fusedlayers.Fp8Recipe, with fused):
    the attention and MLP projections as fusedlayers.flax.Fp8Linear, the MLP's activation
    fusedlayers.jax.swiglu (the head stays bf16)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import fusedlayers.flax as flf
    import fusedlayers.jax as flj
    bf16, dim = jnp.bfloat16, width // heads
    linear = dict(use_bias=False, dtype=bf16, param_dtype=jnp.float32)
    Linear = functools.partial(flf.Fp8Linear, recipe=fp8) if fp8 else nnx.Linear

    Attention = _attention(width, heads, kv_heads, dim, 500000.0, fused, linear, linear_cls=Linear)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.gate_proj = Linear(width, mlp, rngs=rngs, **linear)
            self.up_proj = Linear(width, mlp, rngs=rngs, **linear)
            self.down_proj = Linear(mlp, width, rngs=rngs, **linear)

        def __call__(self, x):
            gate, up = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(flj.swiglu(gate, up) if fp8 else jax.nn.silu(gate) * up)

    def norm(first: bool, rngs):
        cls = nnx.RMSNorm if not fused else flf.RMSNorm if first else flf.AddRMSNorm
        return cls(width, epsilon=1e-5, dtype=bf16, param_dtype=jnp.float32, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, first, rngs):
            self.attn_norm, self.attn = norm(first, rngs), Attention(rngs)
            self.mlp_norm = norm(False, rngs)
            self.mlp = flf.GatedMLP(width, mlp, dtype=bf16, rngs=rngs) if fused and not fp8 \
                else MLP(rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, width, dtype=bf16, param_dtype=jnp.float32, rngs=rngs)
            # nnx.List where flax has it (0.12: a plain list of modules is not a pytree of them)
            self.layers = getattr(nnx, "List", list)([Block(i == 0, rngs)
                                                      for i in range(blocks)])
            self.final_norm = norm(False, rngs)
            if fused:
                self.head = flf.LinearCrossEntropy(width, vocab, dtype=bf16, rngs=rngs)
            else:
                self.head = nnx.Module()
                self.head.kernel = nnx.Param(nnx.initializers.lecun_normal()(
                    rngs.params(), (vocab, width), jnp.float32))

        def __call__(self, ids, labels):
            return _loss(self, ids, labels, fused)

    return Model(nnx.Rngs(seed))


def _train_step(model):
    """(step, state): step(state, ids, labels) -> (state, loss), jitted with the state donated."""
    import jax
    import optax
    from flax import nnx

    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, ids, labels):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: m(ids, labels))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss
    return jax.jit(step, donate_argnums=0), state


def run(name: str, batch: int, rounds: int, steps: int, tiny: bool = False, log=print,
        fp8: bool = False):
    """Rows (label, unfused ms, fused ms, speedup, unfused temp MB, fused temp MB, loss diff);
    with fp8 (the Llama models), also the fused model with its projections in FP8, blockwise
    and tensorwise (each row's speedup over the unfused step; the first loss compared)."""
    import jax
    import numpy as np

    from ..fp8_recipe import Fp8Recipe

    moe = name in MOE_CONFIGS
    config = (MOE_CONFIGS if moe else CONFIGS)["tiny" if tiny else name]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config["vocab"], (batch, config["seq"]), np.int32)
    labels = rng.integers(0, config["vocab"], ids.shape, np.int32)
    first, times, temp, not_run = {}, {}, {}, {}
    variants = {"unfused": dict(fused=False), "fused": dict(fused=True)}
    if moe:
        variants["fused, GEMMs on ragged_dot"] = dict(fused=True, gemm="framework")
    elif fp8:
        variants.update({f"fp8 {s}": dict(fused=True, fp8=Fp8Recipe(s))
                         for s in ("blockwise", "tensorwise")})
    # One model at a time: two with their AdamW states and the unfused step's logits do not
    # fit an 80 GB device at vocabulary 128256, so the rows are sequential, not A/B rounds.
    for key, options in variants.items():
        model = (build_moe if moe else build)(**config, **options)
        first[key] = float(model(ids, labels))
        step, state = _train_step(model)
        del model
        try:
            temp[key] = step.lower(state, ids, labels).compile().memory_analysis() \
                .temp_size_in_bytes / 2 ** 20
            state, loss = step(state, ids, labels)  # compile, warm
            loss.block_until_ready()
        except jax.errors.JaxRuntimeError as e:  # RESOURCE_EXHAUSTED: the row says so
            not_run[key] = did_not_run(e)
            log(f"{key}: did not run: {not_run[key]}")
            del state, step
            continue
        times[key] = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(steps):
                state, loss = step(state, ids, labels)
            loss.block_until_ready()
            times[key].append(1e3 * (time.perf_counter() - start) / steps)
        del state, step
    precision = "bf16 params" if moe else "bf16/f32 params"
    rows = []
    for key in list(variants)[1:]:
        label = "flax " + name + ("-tiny" if tiny else "") + (
            "" if key == "fused" else " " + key if key.startswith("fp8") else " (b)")
        lead = f"{label:<22}{batch:>6} {precision:<16}"
        missing = [k for k in ("unfused", key) if k in not_run]
        if missing:
            rows.append(lead + "; ".join(f"{k} did not run: {not_run[k]}" for k in missing))
            log(rows[-1])
            continue
        diff = abs(first[key] - first["unfused"]) / abs(first["unfused"])
        u, f = (statistics.median(times[k]) for k in ("unfused", key))
        rows.append(f"{lead}{u:>10.2f}{f:>10.2f}{u / f:>8.2f}x"
                    f"{temp['unfused']:>12.0f}{temp[key]:>10.0f}{diff:>12.1e}")
        log(rows[-1])
    if moe:
        log("(b): fused, the experts' GEMMs on jax.lax.ragged_dot")
    return "\n".join(rows)


HEADER = (f"{'model':<22}{'batch':>6} {'precision':<16}{'unfused':>10}{'fused':>10}"
          f"{'speedup':>9}{'temp MB unf':>12}{'fused':>10}{'1st loss':>12}")
