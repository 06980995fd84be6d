"""The errors fusedlayers raises of its own (argument errors are the frameworks' TypeError,
ValueError and InvalidArgumentError). Imports no framework."""


class NotBuiltError(RuntimeError):
    """A fusedlayers library (the PyTorch extension or the TensorFlow op library) is missing,
    fails to build (FUSEDLAYERS_JIT=1) or does not load; the message says which and how to build
    it."""
