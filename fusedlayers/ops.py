"""The op table: one row per public op, read by everything that spans ops (the dispatcher
`fusedlayers.<op>`, the framework packages' exports, the bench, Inductor's decompositions,
`fuse()` in torch and Keras). Imports no framework.

An op's name is its one name everywhere: `fl.<name>`, the modules `fusedlayers/<framework>/<name>.py`
(torch, tensorflow, keras), the kernels' contract `csrc/<name>.h`, the bindings
`backends/<framework>/<name>.*`, the registered operators (`fusedlayers::<name>`,
`Fusedlayers<Name>`) and the errors (`fusedlayers.<name>: ...`). What each framework module
provides is fixed by name (docs/DESIGN.md, "Adding an op"):

- `fusedlayers/torch/<name>.py`: `__all__` (exported by fusedlayers.torch), `reference` (the
  unfused computation in stock torch ops), `DECOMPOSITIONS` (Inductor's lowering of each
  operator; none where Inductor keeps it whole, with `EXPORT_DECOMPOSITIONS` for ONNX export),
  `bench_case(shape, dtype, device, peers)`, and `FUSED_MODULE` when fuse() swaps modules for
  it by the module's own `fuse_candidates` rule;
- `fusedlayers/tensorflow/<name>.py`: `__all__` and `bench_case(shape, dtype)`;
- `fusedlayers/jax/<name>.py`: `__all__` and `bench_case(shape, dtype)`;
- `fusedlayers/keras/<name>.py`: `__all__`; a layer with `fuse_replaces` (the Keras layer class it
  replaces with the same config and weights) is swapped by `fusedlayers.keras.fuse`;
- `fusedlayers/flax/<name>.py`, where the op has a Flax module: `__all__`.
"""

import importlib
import importlib.util
from dataclasses import dataclass

FRAMEWORKS = ("torch", "tensorflow", "jax", "keras", "flax")


@dataclass(frozen=True)
class Op:
    name: str
    # "GB/s" for a memory-bound op (the bench counts the fewest bytes it must move), "TFLOP/s"
    # for one bound by its GEMMs.
    bench_unit: str
    # Device type -> the shapes the bench times it at; --quick takes the first.
    bench_shapes: dict


_NORM_SHAPES = {"cuda": ((32768, 768), (32768, 1024), (32768, 2048), (32768, 4096),
                         (8192, 8192), (8192, 12288)),
                "cpu": ((4096, 768), (1024, 4097))}

_ADD_NORM_SHAPES = {"cuda": ((8192, 2048), (8192, 4096), (8192, 8192)),
                    "cpu": ((4096, 768), (1024, 4097))}

_MOE_SHAPES = {"cuda": ((4096, 2048, 128, 8),), "cpu": ((1024, 512, 16, 4),)}

_GATED_SHAPES = {"cuda": ((8192, 5632), (8192, 14336)), "cpu": ((2048, 2816),)}

OPS = (
    Op("relu_scale", "GB/s", {"cuda": ((32768, 4096),), "cpu": ((2048, 2048),)}),
    Op("linear_gelu", "TFLOP/s",
       {"cuda": ((4096, 1024, 4096), (8192, 4096, 16384)), "cpu": ((2048, 512, 2048),)}),
    Op("layer_norm", "GB/s", _NORM_SHAPES),
    Op("rms_norm", "GB/s", _NORM_SHAPES),
    # a decoder's residual stream at 8192 tokens: Llama-1B, -8B and -70B widths
    Op("add_rms_norm", "GB/s", _ADD_NORM_SHAPES),
    Op("add_layer_norm", "GB/s", _ADD_NORM_SHAPES),
    # (tokens, ffn): Llama-1B and -8B MLPs at 8192 tokens
    Op("swiglu", "GB/s", _GATED_SHAPES),
    Op("geglu", "GB/s", _GATED_SHAPES),
    # (batch, seq, heads, kv_heads, head_dim): Llama-1B and -8B attention, 4 x 2048 tokens
    Op("rope", "GB/s", {"cuda": ((4, 2048, 32, 8, 64), (4, 2048, 32, 8, 128)),
                        "cpu": ((2, 512, 32, 8, 64),)}),
    # (tokens, hidden, vocab): Llama-1B/-3B-wide heads on Llama-2's and Llama-3's vocabularies
    Op("linear_cross_entropy", "TFLOP/s",
       {"cuda": ((8192, 2048, 32000), (8192, 4096, 32000), (8192, 2048, 128256),
                 (8192, 4096, 128256)), "cpu": ((2048, 256, 8192),)}),
    # (tokens, hidden, num_experts, top_k): a Qwen3-30B-A3B-shaped MoE layer at 2 x 2048 tokens
    Op("moe_permute", "GB/s", _MOE_SHAPES),
    Op("moe_unpermute", "GB/s", _MOE_SHAPES),
    # (tokens, k, n, num_groups, top_k): that layer's expert GEMMs over its routed rows, the
    # gate/up projection 2048 -> 2 x 768 and the down projection 768 -> 2048
    Op("grouped_gemm", "TFLOP/s", {"cuda": ((4096, 2048, 1536, 128, 8), (4096, 768, 2048, 128, 8)),
                                   "cpu": ((512, 256, 256, 16, 4),)}),
    # (tokens, hidden, ffn, num_experts, top_k): that layer's experts
    Op("moe_experts", "TFLOP/s", {"cuda": ((4096, 2048, 768, 128, 8),),
                                  "cpu": ((512, 256, 128, 16, 4),)}),
)
NAMES = tuple(op.name for op in OPS)


def get(name: str) -> Op:
    """The row of op `name`; ValueError naming the ops for another name."""
    for op in OPS:
        if op.name == name:
            return op
    raise ValueError(f"fusedlayers: op must be one of {', '.join(NAMES)}, got {name!r}")


def module(op: Op | str, framework: str):
    """The op's module of `framework` (fusedlayers.<framework>.<name>), imported."""
    name = op.name if isinstance(op, Op) else get(op).name
    return importlib.import_module(f"fusedlayers.{framework}.{name}")


def export(package: str, namespace: dict, framework: str, optional: bool = False) -> list[str]:
    """Puts every op module's `__all__` of `framework` into a package's namespace; their names.
    optional: an op may have no module of this framework (flax: the norms only)."""
    names = []
    for op in OPS:
        if optional and importlib.util.find_spec(f"fusedlayers.{framework}.{op.name}") is None:
            continue
        mod = module(op, framework)
        namespace.update({n: getattr(mod, n) for n in mod.__all__})
        names += mod.__all__
    return names
