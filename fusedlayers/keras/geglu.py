"""GeGLU's Keras layer is `GatedMLP(hidden_dim, activation='gelu_tanh')` (or 'gelu'), in
fusedlayers/keras/swiglu.py: one layer for both gated activations."""

__all__ = []
