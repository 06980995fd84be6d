"""Which form a JAX op runs as, chosen while tracing: its custom call to csrc's kernels
("kernel"), or XLA's own formula of the same math ("xla"), under the same custom_vjp and saving
the same residuals, so XLA may fuse it with its neighbours where that wins in a whole step. Each
switchable op's default per backend (`DEFAULTS`) is what measured faster in a training step of
the Llama language model (`python -m fusedlayers bench --framework jax --model llama-lm`;
README, "JAX"). Forced per op with `fusedlayers.jax.set_implementation(op, "kernel" | "xla")`
(None restores the default) or the environment, FUSEDLAYERS_JAX_IMPL="rope=xla,swiglu=kernel",
read at each trace: a function jit has traced keeps the form it was traced with."""

import os

import jax

SWITCHABLE = ("rms_norm", "add_rms_norm", "swiglu", "rope")
IMPLEMENTATIONS = ("kernel", "xla")
# backend -> op -> implementation; ops not named run their kernel.
DEFAULTS: dict = {"gpu": {}, "cpu": {}}
_forced: dict = {}


def set_implementation(op: str, implementation: str | None) -> None:
    """Forces `op` (one of SWITCHABLE) to run its custom call ("kernel") or XLA's formula ("xla")
    in what is traced from now on; None restores the default. ValueError for another op or
    implementation."""
    if op not in SWITCHABLE:
        raise ValueError(f"fusedlayers.jax.set_implementation: op must be one of "
                         f"{', '.join(SWITCHABLE)}, got {op!r}")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"fusedlayers.jax.set_implementation: implementation must be 'kernel', "
                         f"'xla' or None, got {implementation!r}")
    if implementation is None:
        _forced.pop(op, None)
    else:
        _forced[op] = implementation


def _from_environment() -> dict:
    out = {}
    for item in filter(None, os.environ.get("FUSEDLAYERS_JAX_IMPL", "").split(",")):
        op, _, impl = item.partition("=")
        op, impl = op.strip(), impl.strip()
        if op not in SWITCHABLE or impl not in IMPLEMENTATIONS:
            raise ValueError(f"FUSEDLAYERS_JAX_IMPL: each item must be <op>=kernel|xla with op "
                             f"one of {', '.join(SWITCHABLE)}, got {item!r}")
        out[op] = impl
    return out


def implementation(op: str) -> str:
    """The implementation `op` traces as now: forced (set_implementation, then the environment),
    else the default of JAX's default backend."""
    forced = _forced.get(op) or _from_environment().get(op)
    if forced:
        return forced
    return DEFAULTS.get(jax.default_backend(), {}).get(op, "kernel")


def use_xla(op: str) -> bool:
    return implementation(op) == "xla"
