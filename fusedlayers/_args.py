"""Checks of the Python arguments (scalars, shapes) shared by the framework front ends. The
operators check tensors themselves; these run before a value is converted, so that a string or a
float shape is a TypeError naming the argument instead of a conversion error or, worse, a
silently parsed value (float("2") is 2.0). One exception: linear_gelu's tensors in TensorFlow,
where the framework's own matmul runs before our epilogue op, checked here in csrc's words
(csrc/gemm/linear_gelu_check.cpp) before the matmul reports them in its own."""


def real(op: str, name: str, value) -> float:
    """value as a Python float. Accepts what converts to a float by value (int, float, NumPy
    scalars, one-element tensors); raises TypeError for anything else, bool and str included."""
    if isinstance(value, bool) or not hasattr(type(value), "__float__"):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__} "
                        f"{value!r}")
    return float(value)


def normalized_shape(op: str, value) -> tuple:
    """An int or a sequence of ints as a tuple of ints (symbolic sizes kept as they are);
    raises TypeError for anything else."""
    def integral(d) -> bool:
        return not isinstance(d, bool) and hasattr(type(d), "__index__")

    if integral(value):
        return (value,)
    try:
        shape = tuple(value)
    except TypeError:
        shape = None
    if shape is None or not all(integral(d) for d in shape):
        raise TypeError(f"{op}: normalized_shape must be an int or a sequence of ints, got "
                        f"{type(value).__name__} {value!r}")
    return shape


def linear(op: str, x_shape, x_dtype, w_shape, w_dtype, b_shape, b_dtype, approximate: str,
           transpose: bool) -> tuple[int, int]:
    """(in_features, out_features) of linear_gelu's x and weight ((out, in) when `transpose`,
    else a Dense kernel (in, out)) and bias (None where absent); ValueError, or TypeError for a
    dtype, as csrc words it. A size of None (unknown while tracing) passes."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    if len(w_shape) != 2:
        raise ValueError(f"{op}: weight must be 2-D (out_features, in_features), got shape "
                         f"{list(w_shape)}")
    in_features, out_features = (w_shape[1], w_shape[0]) if transpose else tuple(w_shape)
    if len(x_shape) < 1 or x_shape[-1] not in (None, in_features):
        raise ValueError(f"{op}: the last dimension of x must equal in_features = {in_features}, "
                         f"got x of shape {list(x_shape)}")
    for name, dtype in (("weight", w_dtype), ("bias", b_dtype)):
        if dtype is not None and dtype != x_dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x_dtype}, got {dtype}")
    if b_shape is not None and tuple(b_shape) != (out_features,):
        raise ValueError(f"{op}: bias must have shape (out_features,) = ({out_features},), got "
                         f"{list(b_shape)}")
    return in_features, out_features


LOSS_REDUCTIONS = ("mean", "sum", "none")


def linear_cross_entropy(reduction, num_items_in_batch, softcap, input_shape,
                         target_shape) -> None:
    """linear_cross_entropy's Python-side rules (the options csrc never sees, and the shapes
    before they are flattened for it); raises ValueError naming the argument."""
    op = "fusedlayers.linear_cross_entropy"
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {', '.join(LOSS_REDUCTIONS)}, got "
                         f"{reduction!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"{op}: num_items_in_batch divides the 'mean' reduction's sum; got it "
                         f"with reduction {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be None or a positive finite number, got "
                         f"{softcap!r}")
    if len(input_shape) == 0:
        raise ValueError(f"{op}: input must be (..., H), got a 0-d array")
    if tuple(target_shape) != tuple(input_shape[:-1]):
        raise ValueError(f"{op}: target must have input's leading shape "
                         f"{list(input_shape[:-1])}, got {list(target_shape)}")


def loss_layer(layer: str, reduction, **sizes) -> None:
    """A loss layer's constructor rules (Keras' and Flax's LinearCrossEntropy): each size a
    positive int, reduction one of LOSS_REDUCTIONS; ValueError naming the argument."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{layer}: {name} must be a positive integer, got {value!r}")
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"{layer}: reduction must be one of {', '.join(LOSS_REDUCTIONS)}, got "
                         f"{reduction!r}")
