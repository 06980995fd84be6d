"""Train a small MLP-Mixer on scikit-learn's handwritten digits twice with Keras' model.fit,
once with stock Keras layers and once with fusedlayers.keras, and check that both runs learn
the same thing.

    python examples/train_keras.py                        # TensorFlow backend, CPU, 20 epochs
    KERAS_BACKEND=jax python examples/train_keras.py      # JAX backend
    python examples/train_keras.py --help                 # epochs, batch size, seed, plot
    python examples/train_keras.py --distributed          # data parallel over 2 devices

The model is the one of examples/train_torch.py (8x8 images -> 16 tokens of 2x2 patches -> 3
Mixer blocks -> mean pool -> head), trained the same way (AdamW, cosine decay to zero, label
smoothing 0.1). The fused layers stand where their unfused counterparts would be: LayerNorm for
LayerNormalization, FusedLinearGELU for Dense(activation='gelu') as the first layer of every
MLP, and FusedReLUScale for ReLU followed by Rescaling in the head. Both models have the same
weight list (order, names, shapes); the fused model gets the unfused model's initial weights,
both see the batches in the same order, and they train in lockstep: one epoch of each, then the
next, so both meet the same machine load. Both are compiled by XLA (TensorFlow's jit_compile,
or JAX's jit; the fused layers are custom calls inside the compiled step), as Keras compiles the
unfused model on a GPU by itself: like with like. The first epoch includes that compilation.
The script prints each epoch's train loss, held-out accuracy and time for both models, the
time per training step, a summary, and saves the loss curves and their difference as a PNG.

Expected agreement: the fused kernels compute the same math as the unfused ops but sum in a
different order (bias+GELU epilogue, LayerNorm reductions and their gradients), so the two
float32 runs differ by rounding (~1e-7 relative) from the first step. Here those differences
stay at rounding level: the per-epoch train losses (Keras' float32 running means) agree to
~1e-6 relative or better in every epoch, and the held-out accuracies match. The script exits
with status 1 if either run ends below 90% held-out accuracy (--min-accuracy) or if any epoch's
losses differ by more than LOSS_RTOL (1e-2) relative, the bar of train_torch.py, so it doubles
as an end-to-end check of forward, backward and parameter updates through Keras.

With --distributed both models train data parallel over two devices (the GPUs, or the CPU as two
devices): on TensorFlow under `tf.distribute.MirroredStrategy` (without XLA: TF's XLA does not
compile variables placed on other devices), on JAX under `keras.distribution.DataParallel` (the
fused ops run on each device's rows, their parameter gradients summed across devices). Each
global batch is split across the devices, so the losses equal a single-device run's up to
summation order (--json writes them for comparing).
"""

import os
import sys

import fusedlayers

# Before TF loads (Keras imports it): its C++ start-up lines off, unless the user set their level.
fusedlayers.quiet_tensorflow_logs()

if "--distributed" in sys.argv and os.environ.get("KERAS_BACKEND") == "jax":
    # Before JAX starts: without GPUs, the CPU as two devices for DataParallel.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=2").strip()

import argparse
import contextlib
import json
import statistics
import time

import keras
import numpy as np
from keras import layers
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fusedlayers.keras import FusedLinearGELU, FusedReLUScale, LayerNorm
from loss_plot import save_loss_plot

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


def compile_model(model: keras.Model, args, steps: int) -> None:
    model.compile(
        # Cosine decay to zero: no late loss spikes, which would amplify the runs' rounding
        # differences into visibly different curves. epsilon as torch's AdamW.
        optimizer=keras.optimizers.AdamW(
            learning_rate=keras.optimizers.schedules.CosineDecay(2e-3, decay_steps=steps),
            weight_decay=0.05, epsilon=1e-8),
        loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                  label_smoothing=LABEL_SMOOTHING),
        metrics=["accuracy"],
        jit_compile=not (args.distributed and keras.backend.backend() == "tensorflow"))


def train_epoch(model: keras.Model, epoch: int, x, y, order, args, validation):
    """Epoch `epoch` (from 0) over x[order] in batches of args.batch_size (the last partial batch
    left out: replicas average their own batch means, which equals the global mean only when the
    batch splits evenly); returns its train loss, held-out accuracy and step times (s)."""
    order = order[:len(order) // args.batch_size * args.batch_size]
    timer = StepTimer()
    history = model.fit(x[order], y[order], batch_size=args.batch_size, epochs=epoch + 1,
                        initial_epoch=epoch, shuffle=False, validation_data=validation,
                        callbacks=[timer], verbose=0).history
    return history["loss"][-1], history["val_accuracy"][-1], timer.times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-accuracy", type=float, default=MIN_ACCURACY,
                        help=f"the held-out accuracy both runs must reach (default {MIN_ACCURACY};"
                             f" 0 for short runs that only compare the curves)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="train_keras_loss.png", help="loss-curve PNG path")
    parser.add_argument("--json", metavar="PATH", help="also write the per-epoch losses and "
                                                       "accuracies as JSON")
    parser.add_argument("--distributed", action="store_true",
                        help="data parallel over 2 devices (the GPUs, or the CPU as two): "
                             "MirroredStrategy on TensorFlow, DataParallel on JAX")
    args = parser.parse_args()
    replicas, scope = 1, contextlib.nullcontext()
    if args.distributed and keras.backend.backend() == "tensorflow":
        strategy = mirrored()
        replicas, scope = strategy.num_replicas_in_sync, strategy.scope()
    elif args.distributed and keras.backend.backend() == "jax":
        devices = keras.distribution.list_devices()[:2]
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        replicas = len(devices)
    elif args.distributed:
        parser.error(f"--distributed: for the tensorflow and jax backends, not "
                     f"{keras.backend.backend()}")
    with scope:
        return run(args, replicas)


def mirrored():
    """MirroredStrategy over the GPUs, or over the CPU split into two logical devices."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return tf.distribute.MirroredStrategy()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])


def run(args, replicas: int) -> int:
    x_train, x_test, y_train, y_test = load_data()
    print(fusedlayers.loaded(keras.backend.backend()))
    print(f"digits: {len(x_train)} train / {len(x_test)} held-out images, Keras "
          f"{keras.__version__} ({keras.backend.backend()} backend), seed {args.seed}, "
          f"{replicas} replica(s)")

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
          f"weights: {'identical' if same else 'DIFFERENT'}")
    steps = args.epochs * (len(x_train) // args.batch_size)
    for model in (unfused_model, fused_model):
        compile_model(model, args, steps)
    xla = "off (MirroredStrategy)" if not unfused_model.jit_compile else "on for both models"
    print(f"XLA {xla}; epoch 1 includes compiling each model's train and test steps\n")

    # A new permutation every epoch, drawn by NumPy from the seed: the same batches for both.
    rng = np.random.default_rng(args.seed)
    runs = {"unfused": {"loss": [], "accuracy": [], "times": []},
            "fused": {"loss": [], "accuracy": [], "times": []}}
    print(f"{'epoch':>5} {'unfused loss':>13} {'fused loss':>13} {'|diff|':>10} "
          f"{'unfused acc':>12} {'fused acc':>10} {'unfused s':>10} {'fused s':>8}", flush=True)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        seconds = {}
        for name, model in (("unfused", unfused_model), ("fused", fused_model)):
            start = time.perf_counter()
            loss, acc, times = train_epoch(model, epoch, x_train, y_train, order, args,
                                           (x_test, y_test))
            seconds[name] = time.perf_counter() - start
            runs[name]["loss"].append(loss)
            runs[name]["accuracy"].append(acc)
            runs[name]["times"] += times if epoch else []  # the first epoch compiles
        u, f = runs["unfused"], runs["fused"]
        print(f"{epoch + 1:>5} {u['loss'][-1]:>13.6f} {f['loss'][-1]:>13.6f} "
              f"{abs(u['loss'][-1] - f['loss'][-1]):>10.2e} {u['accuracy'][-1]:>12.4f} "
              f"{f['accuracy'][-1]:>10.4f} {seconds['unfused']:>10.2f} {seconds['fused']:>8.2f}",
              flush=True)

    unfused, fused = runs["unfused"], runs["fused"]
    # Median step time after the first epoch: robust to scheduler noise.
    u_ms, f_ms = (1e3 * statistics.median(r["times"] or [float("nan")]) for r in (unfused, fused))
    diffs = [abs(ul - fl) for ul, fl in zip(unfused["loss"], fused["loss"])]
    max_rel = max(d / ul for d, ul in zip(diffs, unfused["loss"]))
    u_acc, f_acc = unfused["accuracy"][-1], fused["accuracy"][-1]
    print(f"\n{'':<24}{'unfused':>10}{'fused':>10}")
    print(f"{'held-out accuracy':<24}{u_acc:>10.4f}{f_acc:>10.4f}")
    print(f"{'final train loss':<24}{unfused['loss'][-1]:>10.5f}{fused['loss'][-1]:>10.5f}")
    print(f"{'ms / step (median)':<24}{u_ms:>10.3f}{f_ms:>10.3f}")
    print(f"{'speedup (fused)':<24}{u_ms / f_ms:>19.2f}x")
    print(f"{'max |loss diff|':<24}{max(diffs):>20.2e}")
    print(f"{'max relative loss diff':<24}{max_rel:>20.2e}   (tolerance {LOSS_RTOL:.0e})")

    save_loss_plot(args.plot, unfused["loss"], fused["loss"],
                   ("unfused (keras.layers)", "fused (fusedlayers.keras)"),
                   f"MLP-Mixer on sklearn digits (Keras, {keras.backend.backend()}): "
                   f"unfused vs fused", f"train loss (label smoothing {LABEL_SMOOTHING})",
                   LOSS_RTOL)
    print(f"loss curves saved to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"replicas": replicas, "backend": keras.backend.backend(),
                       **{name: {"loss": r["loss"], "accuracy": r["accuracy"]}
                          for name, r in runs.items()}}, f, indent=1)

    failures = [f"{name} held-out accuracy {acc:.4f} < {args.min_accuracy}"
                for name, acc in (("unfused", u_acc), ("fused", f_acc))
                if acc < args.min_accuracy]
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
