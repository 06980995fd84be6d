"""Checks of the Python arguments (scalars, shapes) shared by the torch and TensorFlow front ends.
The operators check tensors themselves; these run before a value is converted, so that a string
or a float shape is a TypeError naming the argument instead of a conversion error or, worse, a
silently parsed value (float("2") is 2.0)."""


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
