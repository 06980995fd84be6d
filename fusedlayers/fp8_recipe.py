"""The FP8 training recipe: how the FP8 linear layers of every framework quantize their GEMMs'
operands. Imports no framework."""

from dataclasses import dataclass

GEMMS = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class Fp8Recipe:
    """Which of a linear layer's GEMMs run in FP8 and how their operands are scaled.

    scaling: "blockwise" (default; DeepSeek-V3's recipe, as Transformer Engine's
    Float8BlockScaling: activations and gradients by 1x128 blocks along the contracted
    dimension, weights by 128x128 tiles, scales computed from each block as it is quantized) or
    "tensorwise" (current scaling: one scale per tensor from its amax, as torchao's tensorwise
    float8 and Transformer Engine's Float8CurrentScaling).
    format: "e4m3" (every operand E4M3, max 448) or "hybrid" (E4M3 forward, E5M2 gradients: wider
    range, less precision; tensorwise only, as cuBLASLt's block-scaled kernels take E4M3 alone).
    power_of_2_scales: scales rounded down to powers of two (dequantization exact).
    gemms: those run in FP8, of "fprop" (y = x W^T), "dgrad" (dx = dy W) and "wgrad"
    (dW = dy^T x); the others run in the layer's dtype. With "wgrad" the forward keeps x in FP8
    (x^T, blocked along the tokens) for the backward instead of x itself.
    fast_accum: the fprop GEMM accumulates in Hopper's FP8 accumulators without promoting them
    (faster, less accurate; torchao's default for its forward); tensorwise only.
    recompute_fp8_weights: True (default): the backward quantizes each weight again for its
    dgrad GEMM (as torchao's force_recompute_fp8_weight_in_bwd); False: the forward's FP8 W^T
    is kept until then, one byte a parameter more from the forward to the backward (under FSDP,
    of the unsharded parameters) for one pass over the weights less. The same FP8 values either
    way, so the same gradients.
    wgrad_x_scaling: blockwise only, how the forward quantizes x^T for the weight gradient:
    "1x128" (default; DeepSeek-V3's, blocks of 128 tokens of one feature) or "128x128" (tiles
    of 128 tokens x 128 features, in the same pass as x's 1x128 blocks: the weight gradient then
    runs the 1x128 x 128x128 GEMM that fprop and dgrad run, which cuBLASLt makes faster than
    its 1x128 x 1x128 one; coarser scales for x in that GEMM alone, as Transformer Engine's
    Float8BlockScaling with x_block_scaling_dim=2 scales x). TensorFlow needs the token count
    known while tracing.

    Raises ValueError for an unknown scaling, format, GEMM or wgrad_x_scaling, hybrid or
    fast_accum with blockwise scaling, or wgrad_x_scaling "128x128" with tensorwise scaling.
    """
    scaling: str = "blockwise"
    format: str = "e4m3"
    power_of_2_scales: bool = False
    gemms: tuple = GEMMS
    fast_accum: bool = False
    recompute_fp8_weights: bool = True
    wgrad_x_scaling: str = "1x128"

    def __post_init__(self):
        if self.scaling not in ("blockwise", "tensorwise"):
            raise ValueError(f"fusedlayers.Fp8Recipe: scaling must be 'blockwise' or "
                             f"'tensorwise', got {self.scaling!r}")
        if self.format not in ("e4m3", "hybrid"):
            raise ValueError(f"fusedlayers.Fp8Recipe: format must be 'e4m3' or 'hybrid', got "
                             f"{self.format!r}")
        if self.format == "hybrid" and self.scaling == "blockwise":
            raise ValueError("fusedlayers.Fp8Recipe: format 'hybrid' (E5M2 gradients) needs "
                             "scaling 'tensorwise': block-scaled FP8 GEMMs take E4M3 alone")
        if self.fast_accum and self.scaling == "blockwise":
            raise ValueError("fusedlayers.Fp8Recipe: fast_accum needs scaling 'tensorwise' "
                             "(block scales are applied where the accumulators are promoted)")
        if self.wgrad_x_scaling not in ("1x128", "128x128"):
            raise ValueError(f"fusedlayers.Fp8Recipe: wgrad_x_scaling must be '1x128' or "
                             f"'128x128', got {self.wgrad_x_scaling!r}")
        if self.wgrad_x_scaling == "128x128" and self.scaling != "blockwise":
            raise ValueError("fusedlayers.Fp8Recipe: wgrad_x_scaling '128x128' needs scaling "
                             "'blockwise' (tensorwise scales x^T by the tensor's amax)")
        unknown = set(self.gemms) - set(GEMMS)
        if unknown:
            raise ValueError(f"fusedlayers.Fp8Recipe: gemms must be among {GEMMS}, got "
                             f"{sorted(unknown)}")
        object.__setattr__(self, "gemms", tuple(g for g in GEMMS if g in self.gemms))

    # The operands' scalings and formats, in fp8_quantize's terms.
    @property
    def input_scaling(self) -> str:
        """x's and dy's (and their transposes')."""
        return "1x128" if self.scaling == "blockwise" else "tensorwise"

    @property
    def input_t_scaling(self) -> str:
        """x^T's, the weight gradient's b operand (dy^T, its a, takes input_scaling)."""
        return self.wgrad_x_scaling if self.scaling == "blockwise" else "tensorwise"

    @property
    def weight_scaling(self) -> str:
        return "128x128" if self.scaling == "blockwise" else "tensorwise"

    @property
    def grad_format(self) -> str:
        return "e5m2" if self.format == "hybrid" else "e4m3"
