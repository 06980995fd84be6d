"""fusedlayers: fused ReLU*scale, Linear+GELU, LayerNorm, RMSNorm (and each with the residual add
before it), the gated activations (SwiGLU, GeGLU), rotary embeddings (RoPE), linear + cross-entropy and the experts of
mixture-of-experts layers for PyTorch, TensorFlow and JAX, forward and backward, from one set of
C++ kernels (csrc/).

The functions here pick the framework from the type of their first argument, so the same call
works on any supported tensor. Importing fusedlayers imports no framework: the backend of a
framework is loaded the first time one of its tensors is seen.
"""

import importlib
import importlib.util
import sys
from collections.abc import Sequence

from . import ops
from ._tf_logs import quiet_tensorflow_logs
from .errors import NotBuiltError
from .fp8_recipe import Fp8Recipe

__version__ = "0.1.0"
# The public ops (the table: fusedlayers.ops), each a function below and in every framework
# backend (fusedlayers.torch, fusedlayers.tensorflow, fusedlayers.jax) under the same name.
OPS = ops.NAMES
__all__ = [*OPS, "Fp8Recipe", "NotBuiltError", "loaded", "quiet_tensorflow_logs"]


def _backend(x, op: str, x_name: str = "x", **others):
    """The framework backend (fusedlayers.torch, fusedlayers.tensorflow or fusedlayers.jax) for
    x. Raises TypeError for other types of x, and when one of `others` (the op's other tensors,
    None where absent) is a tensor of another framework: a torch op takes torch tensors only;
    a TensorFlow or JAX op takes what its framework converts (NumPy arrays, lists), but not
    another framework's tensor."""
    # x cannot be a tensor of a framework that is not imported yet.
    torch = sys.modules.get("torch")
    tf = sys.modules.get("tensorflow")
    jax = sys.modules.get("jax")
    frameworks = {"a torch.Tensor": torch and (torch.Tensor,),
                  "a TensorFlow tensor": tf and (tf.Tensor, tf.Variable),
                  "a jax.Array": jax and (jax.Array,)}
    for (name, types), module in zip(frameworks.items(), ("torch", "tensorflow", "jax")):
        if not types or not isinstance(x, types):
            continue
        for arg, t in others.items():
            if t is None:
                continue
            if module == "torch" and not isinstance(t, types):
                raise TypeError(f"fusedlayers.{op}: {x_name} is a torch.Tensor, so {arg} must be one "
                                f"too, got {_type_name(t)}")
            other = next((n for n, ts in frameworks.items() if n != name and ts
                          and isinstance(t, ts)), None)
            if other is not None:
                raise TypeError(f"fusedlayers.{op}: {x_name} is {name}, so {arg} must not be "
                                f"{other}")
        return importlib.import_module(f"fusedlayers.{module}")
    raise TypeError(f"fusedlayers.{op}: {x_name} must be a torch.Tensor, tf.Tensor, tf.Variable or "
                    f"jax.Array, got {_type_name(x)}")


def loaded(*frameworks: str) -> str:
    """One line saying, for each of `frameworks` ("torch", "tensorflow", "jax") that is
    installed, whether its fusedlayers library loaded (importing that backend to find out), e.g.
    "fusedlayers: torch loaded, jax NOT USABLE (python -m fusedlayers info: details)"."""
    parts = []
    for framework in frameworks:
        if importlib.util.find_spec(framework) is None:
            continue
        op = importlib.import_module(f"fusedlayers.{framework}._op")
        parts.append(f"{framework} {'loaded' if op.LOAD_ERROR is None else 'NOT USABLE'}")
    return "fusedlayers: " + (", ".join(parts) or "no framework installed") + \
        " (python -m fusedlayers info: details)"


def _type_name(value) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def relu_scale(x, alpha: float):
    """y = max(x, 0) * alpha. See fusedlayers.torch.relu_scale (or
    fusedlayers.tensorflow.relu_scale) for shapes and errors."""
    return _backend(x, "relu_scale").relu_scale(x, alpha)


def linear_gelu(x, weight, bias=None, approximate: str = "none"):
    """y = gelu(x @ weight^T + bias), weight (out_features, in_features); approximate 'none'
    (erf) or 'tanh'. See fusedlayers.torch.linear_gelu (or
    fusedlayers.tensorflow.linear_gelu) for shapes and errors."""
    backend = _backend(x, "linear_gelu", weight=weight, bias=bias)
    return backend.linear_gelu(x, weight, bias, approximate)


def layer_norm(x, normalized_shape: int | Sequence[int], weight=None, bias=None,
               eps: float = 1e-5):
    """Layer normalization over the trailing normalized_shape dims of x. See
    fusedlayers.torch.layer_norm for shapes, dtypes and errors."""
    backend = _backend(x, "layer_norm", weight=weight, bias=bias)
    return backend.layer_norm(x, normalized_shape, weight, bias, eps)


def rms_norm(x, normalized_shape: int | Sequence[int], weight=None, eps: float | None = None,
             zero_centered: bool = False):
    """RMS normalization over the trailing normalized_shape dims of x. See
    fusedlayers.torch.rms_norm for shapes, dtypes and errors."""
    backend = _backend(x, "rms_norm", weight=weight)
    return backend.rms_norm(x, normalized_shape, weight, eps, zero_centered)


def add_rms_norm(x, residual, normalized_shape: int | Sequence[int], weight=None,
                 eps: float | None = None, zero_centered: bool = False):
    """(y, h): h = x + residual (in residual's dtype), y = rms_norm(h) in x's dtype, in one pass.
    See fusedlayers.torch.add_rms_norm for shapes, dtypes and errors."""
    backend = _backend(x, "add_rms_norm", residual=residual, weight=weight)
    return backend.add_rms_norm(x, residual, normalized_shape, weight, eps, zero_centered)


def add_layer_norm(x, residual, normalized_shape: int | Sequence[int], weight=None, bias=None,
                   eps: float = 1e-5):
    """(y, h): h = x + residual (in residual's dtype), y = layer_norm(h) in x's dtype, in one
    pass. See fusedlayers.torch.add_layer_norm for shapes, dtypes and errors."""
    backend = _backend(x, "add_layer_norm", residual=residual, weight=weight, bias=bias)
    return backend.add_layer_norm(x, residual, normalized_shape, weight, bias, eps)


def swiglu(gate, up):
    """silu(gate) * up, gate and up of one shape and dtype. See fusedlayers.torch.swiglu for
    shapes, dtypes and errors."""
    return _backend(gate, "swiglu", "gate", up=up).swiglu(gate, up)


def geglu(gate, up, approximate: str = "none"):
    """gelu(gate) * up, approximate 'none' (erf) or 'tanh'. See fusedlayers.torch.geglu for
    shapes, dtypes and errors."""
    return _backend(gate, "geglu", "gate", up=up).geglu(gate, up, approximate)


def rope(q, k, cos, sin, unsqueeze_dim: int = 1, interleaved: bool = False):
    """(q_embed, k_embed): rotary position embedding with Hugging Face's apply_rotary_pos_emb
    signature (plus GPT-J's interleaved pairs). See fusedlayers.torch.rope for shapes, dtypes and
    errors."""
    backend = _backend(q, "rope", "q", k=k, cos=cos, sin=sin)
    return backend.rope(q, k, cos, sin, unsqueeze_dim, interleaved)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None,
                         reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, softcap: float | None = None,
                         z_loss: float = 0.0, num_items_in_batch=None, loss_dtype=None):
    """cross_entropy(softcap(input @ linear_weight^T + linear_bias), target) without the logits,
    with PyTorch's F.linear_cross_entropy arguments plus softcap, z_loss, num_items_in_batch and
    loss_dtype (the loss in that dtype from its float32 value; default input's dtype). See
    fusedlayers.torch.linear_cross_entropy for shapes, dtypes and errors."""
    backend = _backend(input, "linear_cross_entropy", "input", linear_weight=linear_weight,
                       target=target, linear_bias=linear_bias)
    return backend.linear_cross_entropy(
        input, linear_weight, target, linear_bias=linear_bias, reduction=reduction,
        ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
        z_loss=z_loss, num_items_in_batch=num_items_in_batch, loss_dtype=loss_dtype)


def moe_permute(x, top_k_index, num_experts: int):
    """(xs, row_index, offsets): the (token, slot) pairs of a mixture-of-experts layer sorted by
    expert (stable) and their rows of x gathered in that order, offsets the end of each expert's
    rows. See fusedlayers.torch.moe_permute for shapes, dtypes and errors."""
    backend = _backend(x, "moe_permute", top_k_index=top_k_index)
    return backend.moe_permute(x, top_k_index, num_experts)


def moe_unpermute(ys, top_k_index, row_index, top_k_weights, num_experts: int):
    """out[t] = sum_j top_k_weights[t, j] * ys[row_index[t * top_k + j]]: the weighted combine
    of the experts' rows, moe_permute's inverse. See fusedlayers.torch.moe_unpermute for shapes,
    dtypes and errors."""
    backend = _backend(ys, "moe_unpermute", "ys", top_k_index=top_k_index, row_index=row_index,
                       top_k_weights=top_k_weights)
    return backend.moe_unpermute(ys, top_k_index, row_index, top_k_weights, num_experts)


def grouped_gemm(x, weight, offsets, *, transposed: bool = False):
    """y[rows of g] = x[rows of g] @ W_g for each group g's rows [offsets[g - 1], offsets[g]):
    a mixture-of-experts layer's expert GEMMs. See fusedlayers.torch.grouped_gemm for shapes,
    dtypes and errors."""
    backend = _backend(x, "grouped_gemm", "x", weight=weight, offsets=offsets)
    return backend.grouped_gemm(x, weight, offsets, transposed=transposed)


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                gate_up_proj_bias=None, down_proj_bias=None, transposed: bool = False,
                activation: str = "silu", gate=None, gemm: str | None = None):
    """The routed experts of a mixture-of-experts layer with transformers' experts arguments:
    moe_permute, a grouped GEMM, the gated activation, a grouped GEMM, moe_unpermute; gemm
    "fusedlayers" (grouped_gemm), "framework" or None (each framework's choice). See
    fusedlayers.torch.moe_experts for shapes, dtypes and errors."""
    backend = _backend(hidden_states, "moe_experts", "hidden_states", top_k_index=top_k_index,
                       top_k_weights=top_k_weights, gate_up_proj=gate_up_proj,
                       down_proj=down_proj, gate_up_proj_bias=gate_up_proj_bias,
                       down_proj_bias=down_proj_bias)
    return backend.moe_experts(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
        gate_up_proj_bias=gate_up_proj_bias, down_proj_bias=down_proj_bias,
        transposed=transposed, activation=activation, gate=gate, gemm=gemm)
