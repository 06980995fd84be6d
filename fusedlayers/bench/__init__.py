"""`python -m fusedlayers bench`: op timings (ops: torch, with tensorflow_ops on the CPU),
whole-model training steps (models) and activation memory (memory); `case` is what an op's
module contributes. The CLI is fusedlayers/__main__.py."""
