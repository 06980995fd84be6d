"""Train a small MLP-Mixer on scikit-learn's handwritten digits twice with Keras' model.fit,
once with stock Keras layers and once with fusedlayers.keras, and check that both runs learn
the same thing.

    python examples/train_keras.py                   # TensorFlow backend, CPU, 20 epochs per run
    python examples/train_keras.py --help            # epochs, batch size, seed, plot
    python examples/train_keras.py --distributed     # tf.distribute.MirroredStrategy, 2 replicas

The model is the one of examples/train_torch.py (8x8 images -> 16 tokens of 2x2 patches -> 3
Mixer blocks -> mean pool -> head), trained the same way (AdamW, cosine decay to zero, label
smoothing 0.1). The fused layers stand where their unfused counterparts would be: LayerNorm for
LayerNormalization, FusedLinearGELU for Dense(activation='gelu') as the first layer of every
MLP, and FusedReLUScale for ReLU followed by Rescaling in the head. Both models have the same
weight list (order, names, shapes); the fused model gets the unfused model's initial weights,
and both runs see the batches in the same order. The runs go one after the other, each with
Keras' own progress output; then the script prints per-epoch train loss and held-out accuracy
side by side, time per training step, a summary, and saves the two loss curves as a PNG.

Expected agreement: the fused kernels compute the same math as the unfused ops but sum in a
different order (bias+GELU epilogue, LayerNorm reductions and their gradients), so the two
float32 runs differ by rounding (~1e-7 relative) from the first step. Here those differences
stay at rounding level: the per-epoch train losses (Keras' float32 running means) agree to
~1e-6 relative or better in every epoch, and the held-out accuracies match. The script exits
with status 1 if either run ends below 90% held-out accuracy or if any epoch's losses differ by
more than LOSS_RTOL (1e-2) relative, the bar of train_torch.py, so it doubles as an end-to-end
check of forward, backward and parameter updates through Keras.

With --distributed both models are built, compiled and fitted under
`tf.distribute.MirroredStrategy` over two logical CPU devices (or the GPUs TensorFlow sees):
each global batch is split across the replicas and their gradients are summed by TensorFlow's
own all-reduce, so the losses equal a single-device run's up to summation order (--json
writes them for comparing).
"""

import os

# Before TF loads: hide its C++ info and warning logs. (TF 2.21 still prints its oneDNN notice at
# import: absl writes it before any log threshold applies.)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import contextlib
import json
import statistics
import sys
import time

import matplotlib

matplotlib.use("Agg")  # headless: only writes a file
import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf
from keras import layers
from matplotlib.ticker import MaxNLocator
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fusedlayers.keras import FusedLinearGELU, FusedReLUScale, LayerNorm

MIN_ACCURACY = 0.90
LOSS_RTOL = 1e-2  # max |loss_unfused - loss_fused| / loss_unfused over epochs, float32
# Regularizes, and keeps the loss away from 0 (its floor is ~0.50), so that the relative loss
# difference stays meaningful once the training set is fit.
LABEL_SMOOTHING = 0.1
EPSILON = 1e-5  # LayerNorm epsilon of torch's nn.LayerNorm, so the model matches train_torch.py


def norm(fused: bool) -> layers.Layer:
    return LayerNorm(epsilon=EPSILON) if fused else layers.LayerNormalization(epsilon=EPSILON)


def mlp(x, hidden: int, fused: bool):
    """Dense -> GELU -> Dense over the last axis; fc1 is one layer either way (kernel, bias),
    so the weight lists of both variants line up."""
    fc1 = FusedLinearGELU(hidden) if fused else layers.Dense(hidden, activation="gelu")
    return layers.Dense(x.shape[-1])(fc1(x))


def build_mixer(fused: bool, dim: int = 64, depth: int = 3, patch: int = 2, image: int = 8,
                classes: int = 10, alpha: float = 0.5) -> keras.Model:
    grid = image // patch
    tokens = grid * grid
    images = keras.Input((image, image))
    # b (h p1) (w p2) -> b (h w) (p1 p2), the same patch and pixel order as train_torch.py.
    x = layers.Reshape((grid, patch, grid, patch))(images)
    x = layers.Permute((1, 3, 2, 4))(x)
    x = layers.Reshape((tokens, patch * patch))(x)
    x = layers.Dense(dim)(x)  # (batch, tokens, dim)
    for _ in range(depth):
        # Token mixing acts along the token axis: Dense sees (batch, dim, tokens).
        y = layers.Permute((2, 1))(norm(fused)(x))
        x = layers.Add()([x, layers.Permute((2, 1))(mlp(y, tokens * 2, fused))])
        x = layers.Add()([x, mlp(norm(fused)(x), dim * 2, fused)])
    x = layers.GlobalAveragePooling1D()(norm(fused)(x))
    # Rectified, down-scaled pooled features for the classifier; alpha is a fixed scale.
    if fused:
        x = FusedReLUScale(alpha)(x)
    else:
        x = layers.Rescaling(alpha)(layers.Activation("relu")(x))
    logits = layers.Dense(classes)(x)
    return keras.Model(images, logits, name="fused_mixer" if fused else "mixer")


def load_data():
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")  # pixels 0..16 -> 0..1
    y = keras.utils.to_categorical(digits.target, 10)  # one-hot, for label smoothing
    return train_test_split(x, y, test_size=0.2, stratify=digits.target, random_state=0)


class StepTimer(keras.callbacks.Callback):
    """Wall time of each training step (forward, backward, optimizer update)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def train(name: str, model: keras.Model, args, x_train, y_train, x_test, y_test):
    """Compiles and fits `model`; returns its History and step times."""
    steps = args.epochs * (len(x_train) // args.batch_size)
    model.compile(
        # Cosine decay to zero: no late loss spikes, which would amplify the runs' rounding
        # differences into visibly different curves. epsilon as torch's AdamW.
        optimizer=keras.optimizers.AdamW(
            learning_rate=keras.optimizers.schedules.CosineDecay(2e-3, decay_steps=steps),
            weight_decay=0.05, epsilon=1e-8),
        loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                  label_smoothing=LABEL_SMOOTHING),
        metrics=["accuracy"],
        # XLA for both models (the fused ops compile to custom calls of their kernels), as
        # Keras' jit_compile="auto" picks on a GPU: like with like. Under MirroredStrategy the
        # replicas' variables live on other devices, which TF's XLA does not compile (its
        # "tf.Variable on a different device" known issue): no XLA there, for both.
        jit_compile=not args.distributed)
    # A new permutation every epoch, drawn by NumPy from the seed: the same batches for both
    # runs and under MirroredStrategy (a seeded tf.data shuffle draws other orders once the
    # strategy rewrites the dataset). One stream of all epochs' batches, read epoch by epoch.
    # Each epoch's last partial batch is left out: replicas average their own batch means, which
    # equals the global batch mean only when the batch splits evenly.
    rng = np.random.default_rng(args.seed)
    orders = np.stack([rng.permutation(len(x_train)) for _ in range(args.epochs)])
    x, y = tf.constant(x_train), tf.constant(y_train)
    batches = (tf.data.Dataset.from_tensor_slices(orders)
               .flat_map(lambda order: tf.data.Dataset.from_tensor_slices(order)
                         .batch(args.batch_size, drop_remainder=True))
               .map(lambda idx: (tf.gather(x, idx), tf.gather(y, idx))))
    keras.utils.set_random_seed(args.seed)
    timer = StepTimer()
    print(f"--- {name} ---")
    history = model.fit(batches, epochs=args.epochs, validation_data=(x_test, y_test),
                        steps_per_epoch=len(x_train) // args.batch_size,
                        callbacks=[timer], shuffle=False,  # `batches` shuffles
                        verbose=2)
    return history.history, timer.times


def save_plot(path: str, unfused: dict, fused: dict) -> None:
    epochs = range(1, len(unfused["loss"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(epochs, unfused["loss"], label="unfused (keras.layers)", linewidth=3, alpha=0.6)
    ax.plot(epochs, fused["loss"], "--", label="fused (fusedlayers.keras)", linewidth=1.5)
    ax.set(xlabel="epoch", ylabel="train loss (cross-entropy, label smoothing 0.1)",
           yscale="log",
           title=f"MLP-Mixer on sklearn digits (Keras, {keras.backend.backend()}): "
                 f"unfused vs fused")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="train_keras_loss.png", help="loss-curve PNG path")
    parser.add_argument("--json", metavar="PATH", help="also write the per-epoch losses and "
                                                       "accuracies as JSON")
    parser.add_argument("--distributed", action="store_true",
                        help="tf.distribute.MirroredStrategy over 2 logical CPU devices (or "
                             "the GPUs)")
    args = parser.parse_args()
    scope = mirrored().scope() if args.distributed else contextlib.nullcontext()
    with scope:
        return run(args)


def mirrored() -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over the GPUs, or over the CPU split into two logical devices."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return tf.distribute.MirroredStrategy()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])


def run(args) -> int:
    x_train, x_test, y_train, y_test = load_data()
    strategy = tf.distribute.get_strategy()
    print(f"digits: {len(x_train)} train / {len(x_test)} held-out images, Keras "
          f"{keras.__version__} ({keras.backend.backend()} backend), seed {args.seed}, "
          f"{strategy.num_replicas_in_sync} replica(s)")

    keras.utils.set_random_seed(args.seed)
    unfused_model = build_mixer(fused=False)
    fused_model = build_mixer(fused=True)
    # set_weights copies by position: check that position i is the same weight in both models.
    layout = [[(v.name, tuple(v.shape)) for v in m.weights] for m in (unfused_model,
                                                                        fused_model)]
    if layout[0] != layout[1]:
        print("FAIL: the unfused and fused models' weight lists do not line up:\n"
              f"  {layout[0]}\n  {layout[1]}", file=sys.stderr)
        return 1
    fused_model.set_weights(unfused_model.get_weights())
    same = all(np.array_equal(a, b) for a, b in zip(unfused_model.get_weights(),
                                                     fused_model.get_weights()))
    print(f"{unfused_model.count_params()} parameters in {len(layout[0])} weight tensors, same "
          f"order, names and shapes in both models; fused model starts from the unfused "
          f"weights: {'identical' if same else 'DIFFERENT'}\n")

    unfused, unfused_times = train("unfused", unfused_model, args, x_train, y_train, x_test,
                                   y_test)
    fused, fused_times = train("fused", fused_model, args, x_train, y_train, x_test, y_test)

    print(f"\n{'epoch':>5} {'unfused loss':>13} {'fused loss':>13} {'|diff|':>10} "
          f"{'unfused acc':>12} {'fused acc':>10}")
    for epoch, (ul, fl, ua, fa) in enumerate(zip(unfused["loss"], fused["loss"],
                                                 unfused["val_accuracy"],
                                                 fused["val_accuracy"]), start=1):
        print(f"{epoch:>5} {ul:>13.6f} {fl:>13.6f} {abs(ul - fl):>10.2e} {ua:>12.4f} {fa:>10.4f}")

    # Median step time: robust to the first step's tracing and to scheduler noise.
    u_ms, f_ms = (1e3 * statistics.median(times) for times in (unfused_times, fused_times))
    diffs = [abs(ul - fl) for ul, fl in zip(unfused["loss"], fused["loss"])]
    max_rel = max(d / ul for d, ul in zip(diffs, unfused["loss"]))
    u_acc, f_acc = unfused["val_accuracy"][-1], fused["val_accuracy"][-1]
    print(f"\n{'':<24}{'unfused':>10}{'fused':>10}")
    print(f"{'held-out accuracy':<24}{u_acc:>10.4f}{f_acc:>10.4f}")
    print(f"{'final train loss':<24}{unfused['loss'][-1]:>10.5f}{fused['loss'][-1]:>10.5f}")
    print(f"{'ms / step (median)':<24}{u_ms:>10.3f}{f_ms:>10.3f}")
    print(f"{'speedup (fused)':<24}{u_ms / f_ms:>19.2f}x")
    print(f"{'max |loss diff|':<24}{max(diffs):>20.2e}")
    print(f"{'max relative loss diff':<24}{max_rel:>20.2e}   (tolerance {LOSS_RTOL:.0e})")

    save_plot(args.plot, unfused, fused)
    print(f"loss curves saved to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"replicas": tf.distribute.get_strategy().num_replicas_in_sync,
                       **{name: {"loss": h["loss"], "accuracy": h["val_accuracy"]}
                          for name, h in (("unfused", unfused), ("fused", fused))}}, f, indent=1)

    failures = [f"{name} held-out accuracy {acc:.4f} < {MIN_ACCURACY}"
                for name, acc in (("unfused", u_acc), ("fused", f_acc)) if acc < MIN_ACCURACY]
    if not same:
        failures.append("fused model did not start from the unfused weights")
    if max_rel > LOSS_RTOL:
        failures.append(f"loss curves differ by {max_rel:.2e} relative > {LOSS_RTOL:.0e}")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        print("OK: both runs reach the accuracy bar and their loss curves agree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
