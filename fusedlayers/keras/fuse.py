"""`fuse(model)`: a clone of a Keras Sequential or functional model (keras.models.clone_model) with
each layer that a fused layer replaces with the same config and weights (its `fuse_replaces`:
`LayerNormalization` -> `LayerNorm`, `RMSNormalization` -> `RMSNorm`) swapped, and its `Dense`
layers with a GELU activation as `FusedLinearGELU`, the weights copied. The GELU is recognised
by what the activation computes (erf or tanh GELU on a float64 probe from -100 to 100, float32 on
JAX without x64), not by its name; each swapped layer is checked against the original on a probe
input and, if it differs, left as it was and reported,
as is the whole model's output. The report is `clone.fusedlayers_report`.
"""

import importlib.util
import math

import keras
import numpy as np

from .. import ops
from ..fuse_report import FuseReport, class_name
from .linear_gelu import FusedLinearGELU

# ||fused - original|| / ||original|| allowed on a probe, per compute dtype.
_TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
_PROBE_ROWS = 5
# Dense's configuration that FusedLinearGELU takes as is (all of it but the activation and LoRA).
_DENSE_KEYS = ("units", "use_bias", "kernel_initializer", "bias_initializer",
               "kernel_regularizer", "bias_regularizer", "activity_regularizer",
               "kernel_constraint", "bias_constraint", "name", "dtype", "trainable")


def fuse(model: keras.Model, *, verbose: bool = False, **enabled: bool) -> keras.Model:
    """A clone of `model` with LayerNormalization -> LayerNorm, RMSNormalization -> RMSNorm and
    Dense(activation=GELU) -> FusedLinearGELU (same names, configs and weights); `model` itself
    is left unchanged.

    model: a built Sequential or functional keras.Model (subclassed models cannot be cloned:
    swap their layers in their code). enabled: one keyword per op of fusedlayers.ops
    (layer_norm=False leaves the LayerNormalizations, ...); every op is fused by default.
    Returns the clone; its `fusedlayers_report` lists what was swapped and what was left, and
    why (printed when verbose). Raises TypeError for anything else than a built Sequential or
    functional model, or a keyword that names no op.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"fusedlayers.keras.fuse: model must be a keras.Model, got "
                        f"{type(model).__module__}.{type(model).__qualname__}")
    unknown = set(enabled) - set(ops.NAMES)
    if unknown:
        raise TypeError(f"fusedlayers.keras.fuse: unexpected keyword(s) {sorted(unknown)}; the "
                        f"ops are {', '.join(ops.NAMES)}")
    replacements = {}  # Keras layer class -> the fused layer class with its config and weights
    for op in ops.OPS:
        if not enabled.get(op.name, True) or \
                importlib.util.find_spec(f"fusedlayers.keras.{op.name}") is None:
            continue  # an op without a Keras layer (moe_permute, moe_unpermute)
        for name in ops.module(op, "keras").__all__:
            fused = getattr(ops.module(op, "keras"), name)
            if getattr(fused, "fuse_replaces", None) is not None:
                replacements[fused.fuse_replaces] = fused
    linear_gelu = enabled.get("linear_gelu", True)
    if not getattr(model, "inputs", None):  # subclassed, or a Sequential without an Input
        raise TypeError(f"fusedlayers.keras.fuse: model must be a Sequential or functional model "
                        f"with a keras.Input; {type(model).__qualname__} has no symbolic inputs "
                        f"(a subclassed model cannot be cloned: use fusedlayers.keras layers in "
                        f"its code instead)")
    excluded, probe_left = set(), []  # layers whose swap failed its probe: cloned as they are
    while True:
        swaps, left = {}, []
        try:
            clone = keras.models.clone_model(
                model, recursive=True, clone_function=lambda layer: _swap(
                    layer, swaps, excluded, left, replacements, linear_gelu))
        except ValueError as e:  # clone_model refuses subclassed models
            raise TypeError(f"fusedlayers.keras.fuse: model must be a Sequential or functional "
                            f"model; {type(model).__qualname__} cannot be cloned ({e}); use "
                            f"fusedlayers.keras layers in its code instead") from e
        clone.set_weights(model.get_weights())
        if not _verify(swaps, excluded, probe_left):
            break
    report = FuseReport([(name, was, now) for name, (was, now, _) in swaps.items()],
                        probe_left + left)
    _check_model(model, clone)
    clone.fusedlayers_report = report
    if verbose:
        print(report)
    return clone


def _gelu_form(activation) -> str | None:
    """'none' or 'tanh' when `activation` computes erf or tanh GELU, else None."""
    x = np.concatenate([np.linspace(-8, 8, 513), [-100.0, -20.0, 20.0, 100.0]])
    # float64 where the backend has it (JAX only with jax_enable_x64).
    dtype = "float32" if keras.backend.backend() == "jax" and not _jax_x64() else "float64"
    try:
        y = keras.ops.convert_to_numpy(activation(keras.ops.convert_to_tensor(x, dtype)))
    except Exception:  # not an elementwise function of one tensor
        return None
    erf = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    # TensorFlow's float64 GELU is within 5e-9 of exact; erf and tanh differ by 5e-4.
    tol = 1e-7 if dtype == "float64" else 1e-5
    for form, ref in (("none", erf), ("tanh", tanh)):
        if y.shape == x.shape and np.allclose(y, ref, rtol=tol, atol=tol):
            return form
    return None


def _jax_x64() -> bool:
    import jax
    return bool(jax.config.jax_enable_x64)


def _swap(layer, swaps, excluded, left, replacements, linear_gelu):
    config = layer.get_config()
    if layer.name in excluded:
        return layer.__class__.from_config(config)
    now = replacements.get(type(layer))
    if now is not None:  # the same config keys and weights, in order
        new = now.from_config(config)
        swaps[layer.name] = (class_name(type(layer)), class_name(now), (layer, new))
        return new
    if linear_gelu and type(layer) is keras.layers.Dense:
        form = _gelu_form(layer.activation)
        if form is not None:
            if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
                left.append((layer.name, f"{class_name(type(layer))}(activation=gelu)",
                             "LoRA or quantized: not fused"))
                return layer.__class__.from_config(config)
            new = FusedLinearGELU.from_config(
                {k: v for k, v in config.items() if k in _DENSE_KEYS} |
                {"approximate": form == "tanh"})
            swaps[layer.name] = (f"{class_name(type(layer))}(activation=gelu, approximate="
                                 f"{form!r})", class_name(FusedLinearGELU), (layer, new))
            return new
    if type(layer) is keras.layers.Activation and _gelu_form(layer.activation) is not None:
        left.append((layer.name, "Activation(GELU)",
                            "a separate activation layer: give the Dense before it "
                            "activation='gelu' to fuse the pair"))
    return layer.__class__.from_config(config)


def _rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (den if den > 0 else 1.0))


def _probe(shape, dtype, seed):
    x = np.random.default_rng(seed).normal(size=shape).astype("float32")
    return keras.ops.cast(keras.ops.convert_to_tensor(x), dtype)


def _verify(swaps, excluded, left) -> bool:
    """Each swapped layer against its original on a probe; True when one differs (it is then
    excluded, reported, and the model cloned again)."""
    failed = False
    for name, (was, now, (old, new)) in swaps.items():
        x = _probe(tuple(d or _PROBE_ROWS for d in old.input.shape), old.compute_dtype, 0)
        try:
            err = _rel_err(keras.ops.convert_to_numpy(keras.ops.cast(new(x), "float32")),
                           keras.ops.convert_to_numpy(keras.ops.cast(old(x), "float32")))
            why = f"probe mismatch (relative error {err:.1e})"
        except Exception as e:
            err, why = float("inf"), f"the fused op fails on it: {e}"
        if err > _TOLERANCE.get(old.compute_dtype, 0.0):
            left.append((name, was, why))
            excluded.add(name)
            failed = True
    return failed


def _check_model(model, clone) -> None:
    """The whole clone against the original on one probe batch (inference mode)."""
    inputs = [_probe(tuple(d or 2 for d in t.shape), t.dtype, i) if "float" in str(t.dtype)
              else np.zeros(tuple(d or 2 for d in t.shape), str(t.dtype))
              for i, t in enumerate(model.inputs)]
    inputs = inputs[0] if len(inputs) == 1 else inputs
    err, tol = 0.0, 0.0
    for got, ref in zip(keras.tree.flatten(clone(inputs)), keras.tree.flatten(model(inputs))):
        err = max(err, _rel_err(keras.ops.convert_to_numpy(keras.ops.cast(got, "float32")),
                                keras.ops.convert_to_numpy(keras.ops.cast(ref, "float32"))))
        tol = max(tol, 10 * _TOLERANCE.get(keras.backend.standardize_dtype(ref.dtype), 0.0))
    if err > tol:
        raise RuntimeError(f"fusedlayers.keras.fuse: the fused model's output differs from the "
                           f"original's by {err:.1e} (relative) although each swapped layer "
                           f"matched its own; please report this model")
