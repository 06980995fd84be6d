"""MoEExperts for Keras 3: the routed experts of a mixture-of-experts block (gate/up and down
projections per expert, as transformers' experts modules hold them), run by fusedlayers'
moe_experts on every backend: moe_permute, the backend's grouped GEMM, swiglu / geglu,
moe_unpermute."""

import keras

from ._layer import FusedLayer, framework

__all__ = ["MoEExperts"]

_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@keras.saving.register_keras_serializable(package="fusedlayers")
class MoEExperts(FusedLayer):
    """The experts of a mixture-of-experts block (Shazeer et al. 2017, arXiv:1701.06538):
    out[t] = sum_j top_k_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)),
    e = top_k_index[t, j], with weights `gate_up_proj` (num_experts, 2 * ffn_dim, hidden), the
    gate's rows first, and `down_proj` (num_experts, hidden, ffn_dim), transformers' layout (a
    checkpoint's tensors load as they are). The router is the caller's: it gives top_k_index
    and top_k_weights.

    call(hidden_states (tokens, hidden), top_k_index (tokens, top_k) int32/int64, top_k_weights
    (tokens, top_k)) -> (tokens, hidden). Under TensorFlow the expert GEMMs are a matmul per
    expert over its rows, which XLA cannot compile (sizes known only when it runs): the layer
    says so through `supports_jit`. Raises ValueError for a non-positive num_experts or ffn_dim
    or another activation."""

    def __init__(self, num_experts: int, ffn_dim: int, activation: str = "silu",
                 kernel_initializer="glorot_uniform", **kwargs):
        for name, value in (("num_experts", num_experts), ("ffn_dim", ffn_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEExperts: {name} must be a positive integer, got {value!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"MoEExperts: activation must be one of {', '.join(_ACTIVATIONS)}, "
                             f"got {activation!r}")
        super().__init__(**kwargs)
        self.num_experts, self.ffn_dim, self.activation = num_experts, ffn_dim, activation
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.supports_jit = keras.backend.backend() != "tensorflow"

    def build(self, input_shape):
        hidden = input_shape[0][-1] if isinstance(input_shape[0], (list, tuple)) else \
            input_shape[-1]
        self.gate_up_proj = self.add_weight(
            name="gate_up_proj", shape=(self.num_experts, 2 * self.ffn_dim, hidden),
            initializer=self.kernel_initializer)
        self.down_proj = self.add_weight(
            name="down_proj", shape=(self.num_experts, hidden, self.ffn_dim),
            initializer=self.kernel_initializer)

    def call(self, hidden_states, top_k_index, top_k_weights):
        fl = framework("MoEExperts")
        return fl.moe_experts(hidden_states, top_k_index, top_k_weights,
                              self.gate_up_proj.value, self.down_proj.value,
                              activation=self.activation)

    def compute_output_shape(self, hidden_states_shape, *_):
        return hidden_states_shape

    def get_config(self):
        return {**super().get_config(), "num_experts": self.num_experts,
                "ffn_dim": self.ffn_dim, "activation": self.activation,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}
