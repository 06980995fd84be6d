"""`python -m fusedlayers info` reports which backends (torch extension, TensorFlow op library,
JAX library) are built and usable, for which devices, and why not; `python -m fusedlayers bench` times fused
against unfused ops (fusedlayers.bench)."""

import argparse
import importlib.util
import os
import platform
import sys

import fusedlayers
from fusedlayers.ops import NAMES as OPS

# Before TensorFlow loads (its rows, info): its C++ start-up logs off, unless the user set them.
fusedlayers.quiet_tensorflow_logs()


def _torch_info() -> bool:
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed")
        return True
    import torch
    from fusedlayers.torch import _op
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    if _op.LOAD_ERROR is not None:
        print(f"  extension: not usable: {_op.LOAD_ERROR}")
        return False
    kernels = [key for key in ("CPU", "CUDA")
               if torch._C._dispatch_has_kernel_for_dispatch_key("fusedlayers::layer_norm", key)]
    print(f"  extension: loaded; kernels for {', '.join(kernels)}"
          + ("" if "CUDA" in kernels else " (built without CUDA kernels)"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            hopper = (p.major, p.minor) == (9, 0) and _hopper_built()
            print(f"  cuda:{i} {p.name} sm_{p.major}{p.minor}; {_grouped_gemm_path(hopper)}")
    return True


def _hopper_built() -> bool:
    """Whether setup.py built the grouped GEMM's Hopper kernels (its summary, _build.txt)."""
    build = os.path.join(os.path.dirname(fusedlayers.__file__), "_build.txt")
    return os.path.exists(build) and "Hopper grouped GEMM: built" in open(build).read()


def _grouped_gemm_path(hopper: bool) -> str:
    return ("grouped_gemm: CUTLASS's Hopper kernels (bfloat16, widths multiples of 8; else the "
            "tiled kernel)" if hopper else
            "grouped_gemm: the tiled kernel (moe_experts: the framework's grouped GEMM)")


def _tensorflow_info() -> bool:
    if importlib.util.find_spec("tensorflow") is None:
        print("tensorflow: not installed")
        return True
    import tensorflow as tf
    from fusedlayers.tensorflow import _op
    print(f"tensorflow {tf.__version__}")
    if _op.LOAD_ERROR is not None:
        print(f"  op library: not usable: {_op.LOAD_ERROR}")
        return False
    from tensorflow.python.framework import kernels
    devices = sorted({k.device_type for k in kernels.get_registered_kernels_for_op(
        "FusedlayersLayerNorm").kernel})
    gpus = tf.config.list_physical_devices("GPU")
    print(f"  op library: loaded; kernels for {', '.join(devices)}; TensorFlow sees "
          f"{len(gpus)} GPU{'' if len(gpus) == 1 else 's'}")
    return True


def _jax_info() -> bool:
    if importlib.util.find_spec("jax") is None:
        print("jax: not installed")
        return True
    import jax
    from fusedlayers.jax import _op
    print(f"jax {jax.__version__} (devices: {', '.join(d.platform for d in jax.devices())})")
    if _op.LOAD_ERROR is not None:
        print(f"  library: not usable: {_op.LOAD_ERROR}")
        return False
    cuda = hasattr(_op.lib, "fusedlayers_xla_layer_norm_forward_cuda")
    print(f"  library: loaded; XLA custom-call handlers for CPU{', CUDA' if cuda else ''}")
    if cuda:
        from fusedlayers import _csrc_check
        for d in (d for d in jax.devices() if d.platform == "gpu"):
            major, minor = (int(v) for v in d.compute_capability.split("."))
            hopper = _csrc_check.grouped_gemm_hopper(_op.lib, 8, 8, 8, 1, _op.csrc_dtype(
                jax.numpy.bfloat16), major * 10 + minor)
            print(f"  {d} sm_{major}{minor}; {_grouped_gemm_path(hopper)}")
    return True


def info() -> int:
    print(f"fusedlayers {fusedlayers.__version__}, Python {platform.python_version()}")
    build = os.path.join(os.path.dirname(fusedlayers.__file__), "_build.txt")
    if os.path.exists(build):  # what setup.py built, and why not the rest
        with open(build) as f:
            print("build: " + "       ".join(f.readlines()), end="")
    ok = _torch_info()
    ok = _tensorflow_info() and ok
    ok = _jax_info() and ok
    return 0 if ok else 1


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedlayers bench")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--framework", choices=("torch", "jax", "tensorflow"), default="torch",
                        help="torch (with TensorFlow's rows on the CPU), jax (fusedlayers.jax "
                             "against XLA's own ops, on JAX's default device) or tensorflow "
                             "(fusedlayers.tensorflow against TensorFlow's and Keras' own ops, "
                             "also under XLA, on TensorFlow's default device)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--ops", default=",".join(OPS),
                        help="comma-separated ops to bench (default: all)")
    parser.add_argument("--quick", action="store_true", help="one shape per op")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--peers", action="store_true",
                        help="add Liger-Kernel's and QuACK's kernels where they import (CUDA); "
                             "--model llama* and qwen3-moe: Liger's patched model, eager")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip the TensorFlow rows (CPU; they run where the op library loads)")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds (default 5, 3 with --quick): each row is timed "
                             "once a round, beside the other rows of its case, and reported as "
                             "the median with the rounds' range; a speedup whose range includes "
                             "1.0 is a tie (--model: A/B rounds)")
    parser.add_argument("--reps", type=int,
                        help="calls per round on the CPU (default: as many as take ~30 ms, at "
                             "least one), loop runs per round under JAX (default 4); on CUDA "
                             "each round times ~30 ms of calls")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG bar chart")
    model = parser.add_argument_group(
        "whole models", "--model times training steps of a Hugging Face model (built from "
        "config), unfused vs fusedlayers.torch.fuse, instead of single ops; with --framework "
        "jax, of a Keras model on Keras' JAX backend (bert-base: a BERT-base-shaped encoder; "
        "llama: 4 Llama-1B-shaped decoder blocks; llama-lm, llama-lm-128k: the ~1.1B Llama LM "
        "with its head and loss; llama-8b-layers: Llama-3-8B's layer shape, torch only), "
        "unfused vs fused")
    model.add_argument("--model", choices=("bert-base", "vit-base", "gpt2", "llama", "llama-lm",
                                           "llama-lm-128k", "qwen3-moe", "llama-8b-layers"))
    model.add_argument("--tiny", action="store_true", help="2 layers of width 64 (CPU, tests)")
    model.add_argument("--jax-impl", default="",
                       help="with --framework jax: ';'-separated FUSEDLAYERS_JAX_IMPL settings "
                            "the fused model is timed under, one row each (e.g. "
                            "';rope=xla;swiglu=xla': the defaults, then each op as XLA's formula)")
    model.add_argument("--batch", help="comma-separated batch sizes (default: a host-bound and "
                                       "a GPU-bound one on CUDA, 8 on the CPU)")
    model.add_argument("--precision",
                       help="torch: autocast (bf16 compute, fp32 params), bf16 (bf16 params), "
                            "bf16-master (bf16 params, float32 masters in fusedlayers' AdamW), "
                            "fp32 (default: autocast,bf16; qwen3-moe: bf16); Keras: its dtype "
                            "policies, mixed_bfloat16 or float32 (default: mixed_bfloat16)")
    model.add_argument("--layers", type=int,
                       help="torch: the Llamas' and the MoE's decoder layers (default: the "
                            "model's; qwen3-moe with float32 parameters: 4, as 8 do not fit 80 GB)")
    model.add_argument("--modes", default="eager,compile", help="eager and/or compile")
    model.add_argument("--adamw", choices=("torch", "fusedlayers"), default="torch",
                       help="torch: the optimizer, torch.optim.AdamW (fused on CUDA) or "
                            "fusedlayers.torch.AdamW (precision bf16-master always takes it)")
    model.add_argument("--steps", type=int, default=4, help="timed steps per model per round")
    model.add_argument("--distributed", action="store_true",
                       help="under torchrun: both models in DistributedDataParallel, one GPU per "
                            "process (NCCL; gloo on the CPU); --batch is per process")
    parser.add_argument("--optimizer", action="store_true",
                        help="time one AdamW step over a model's parameters (GB/s), "
                             "fusedlayers.torch.AdamW beside torch's; with --framework jax, "
                             "optax's")
    parser.add_argument("--fp8", action="store_true",
                        help="time FP8 quantization (GB/s; beside the same in stock torch ops, "
                             "eager and compiled), the FP8 GEMMs (TFLOP/s; beside bf16 and "
                             "torch._scaled_mm) and two Llama-3-8B MLP blocks (beside bf16 and, "
                             "with --peers, torchao's float8) (fusedlayers.bench.fp8*); with "
                             "--model, the model also as fuse(model, fp8=) with each recipe "
                             "(and, with --peers, torchao's float8, compiled); with "
                             "--framework jax, fusedlayers.jax's FP8 ops beside XLA's bf16 "
                             "(fusedlayers.bench.jax_fp8), and with --model the Flax and Keras "
                             "Llamas with FP8 projections")
    memory = parser.add_argument_group(
        "memory", "--memory reports the activation memory of a training step, unfused vs fused, "
        "for a 12-block MLP stack and the --model models (fusedlayers.bench.memory)")
    memory.add_argument("--memory", action="store_true")
    memory.add_argument("--memory-models", default="mlp,bert-base,vit-base,gpt2",
                        help="comma-separated, of mlp and the --model names")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    if args.optimizer:
        return _bench_optimizer(args)
    if args.fp8 and not args.model:
        if args.framework == "jax":
            from fusedlayers.bench import jax_fp8
            import jax
            print(f"device: {jax.devices()[0].device_kind}\n", flush=True)
            jax_fp8.run(rounds=args.rounds, log=lambda line: print(line, flush=True))
            return 0
        return _bench_fp8(args)
    if args.framework == "tensorflow":
        if args.model or args.memory:
            parser.error("--framework tensorflow: the op bench only")
        return _bench_tensorflow(args)
    if args.framework == "jax" and args.model:
        if args.model not in ("bert-base", "llama", "llama-lm", "llama-lm-128k", "qwen3-moe"):
            parser.error("--framework jax --model: bert-base, llama, llama-lm, llama-lm-128k or "
                         "qwen3-moe")
        return _bench_keras_model(args)

    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    if device == "cpu":
        name += f" ({torch.get_num_threads()} threads)"
    if args.memory:
        return _bench_memory(args, device, name)
    if args.model:
        if args.distributed and "LOCAL_RANK" not in os.environ:
            parser.error("--distributed: launch with torchrun, e.g. `torchrun --nproc-per-node 2 "
                         "-m fusedlayers bench --model bert-base --distributed`")
        return _bench_model(args, device, name)
    from fusedlayers.bench import table
    tf_rows = device == "cpu" and not args.no_tensorflow and args.framework == "torch"
    frameworks = ("jax",) if args.framework == "jax" else ("torch", "tensorflow")[:1 + tf_rows]
    print(fusedlayers.loaded(*frameworks), flush=True)
    if args.framework == "jax":
        import jax
        from fusedlayers.bench import jax_ops
        name = f"{jax.devices()[0].device_kind} (JAX {jax.__version__})"
        rows, ceilings = jax_ops.run(tuple(args.dtypes.split(",")), args.quick,
                                     args.reps or jax_ops.REPS, tuple(args.ops.split(",")),
                                     rounds=args.rounds)
    else:
        from fusedlayers.bench import ops as b
        rows, ceilings = b.run(device, tuple(args.dtypes.split(",")), args.quick,
                               not args.no_compile, args.reps,
                               tuple(args.ops.split(",")), args.peers, not args.no_tensorflow,
                               args.rounds, _row_printer(args, name))
        print("== all rows")
    return _report(args, rows, ceilings, name)


def _report(args, rows, ceilings: dict, name: str) -> int:
    """Prints the op bench's rows, judged, and writes --json and --plot."""
    from fusedlayers.bench import table
    table.per_size_floors(rows, ceilings)
    table.judge(rows)
    print(table.format_table(rows, ceilings, name))
    if args.json:
        table.write_json(args.json, rows, ceilings, name)
    if args.plot:
        table.plot(args.plot, rows, name)
    return 0


def _row_printer(args, name: str):
    """on_rows(rows, ceilings) for a bench's run: prints the rows added since its last call (each
    case as it ends: nothing lost if a later one dies) and rewrites --json."""
    from fusedlayers.bench import table
    printed = []

    def on_rows(rows, ceilings):
        table.per_size_floors(rows, ceilings)
        table.judge(rows)
        lines = table.format_table(rows, ceilings, name).splitlines()
        print("\n".join(lines[4 + len(printed):] if printed else lines), flush=True)
        printed[:] = rows
        if args.json:
            table.write_json(args.json, rows, ceilings, name)
    return on_rows


def _bench_tensorflow(args) -> int:
    from fusedlayers.bench import tensorflow_ops
    print(fusedlayers.loaded("tensorflow"), flush=True)
    name = tensorflow_ops.device_name()
    rows, ceilings = tensorflow_ops.run(tuple(args.dtypes.split(",")), args.quick,
                                        args.reps or tensorflow_ops.REPS,
                                        tuple(args.ops.split(",")), rounds=args.rounds,
                                        on_rows=_row_printer(args, name))
    print("== all rows")
    return _report(args, rows, ceilings, name)


def _bench_model(args, device: str, name: str) -> int:
    import torch
    import torch.distributed as dist
    from fusedlayers.bench import models as mb
    first = True
    if args.distributed:
        if device.startswith("cuda"):
            device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        first = dist.get_rank() == 0
        name += f" x {dist.get_world_size()} processes, DDP (batch per process)"
    say = (lambda line: print(line, flush=True)) if first else (lambda line: None)
    say(f"device: {name}\n{mb.HEADER}")
    rows = mb.run(args.model, device,
                  tuple(int(b) for b in args.batch.split(",")) if args.batch else None,
                  tuple(args.precision.split(",")) if args.precision else None,
                  tuple(args.modes.split(",")),
                  args.rounds, args.steps, tiny=args.tiny, log=say, distributed=args.distributed,
                  peers=args.peers, layers=args.layers, adamw=args.adamw, fp8=args.fp8)
    if args.distributed:
        dist.destroy_process_group()
    if first and args.json:
        mb.write_json(args.json, rows, name)
    if first and args.plot:
        mb.plot(args.plot, rows, name)
    return 0


def _bench_keras_model(args) -> int:
    from fusedlayers.bench import keras_models as km
    import jax
    name = f"{jax.devices()[0].device_kind} (JAX {jax.__version__})"
    if args.model.startswith("llama-lm") or args.model == "qwen3-moe":  # Flax NNX, then Keras'
        from fusedlayers.bench import flax_models as fm
        print(f"device: {name}, Flax NNX\n{fm.HEADER}", flush=True)
        default = "2" if args.tiny or args.model == "qwen3-moe" else "4"
        for batch in (args.batch.split(",") if args.batch else (default,)):
            fm.run(args.model, int(batch), args.rounds, args.steps, tiny=args.tiny,
                   log=lambda line: print(line, flush=True), fp8=args.fp8)
        if args.model == "qwen3-moe":  # the Flax model alone: Keras has no MoE model here
            return 0
    print(f"device: {name}, Keras' JAX backend\n{km.HEADER}", flush=True)
    if importlib.util.find_spec("keras") is None:
        print(f"{args.model}: did not run: keras is not installed", flush=True)
        return 0
    rows = km.run(args.model, tuple(int(b) for b in args.batch.split(",")) if args.batch else None,
                  tuple((args.precision or "mixed_bfloat16").split(",")), args.rounds,
                  args.steps, tiny=args.tiny, variants=tuple(args.jax_impl.split(";")),
                  log=lambda line: print(line, flush=True), fp8=args.fp8)
    if args.json:
        km.write_json(args.json, rows, name)
    return 0


def _bench_optimizer(args) -> int:
    from fusedlayers.bench import optimizer as ob
    say = lambda line: print(line, flush=True)  # noqa: E731
    if args.framework == "jax":
        import jax
        name = f"{jax.devices()[0].device_kind} (JAX {jax.__version__})"
        say(f"device: {name}\n{ob.HEADER}")
        rows = ob.run_optax(rounds=args.rounds, log=say)
    else:
        import torch
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        name = torch.cuda.get_device_name() if device.startswith("cuda") else \
            f"{platform.processor() or 'cpu'} ({torch.get_num_threads()} threads)"
        say(f"device: {name}\n{ob.HEADER}")
        rows = ob.run(device, rounds=args.rounds, log=say)
    if args.json:
        ob.write_json(args.json, rows, name)
    return 0


def _bench_fp8(args) -> int:
    import json

    import torch

    from fusedlayers.bench import fp8, fp8_gemm, fp8_mlp
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else \
        f"{platform.processor() or 'cpu'} ({torch.get_num_threads()} threads)"
    say = lambda line: print(line, flush=True)  # noqa: E731
    say(f"device: {name}\n\nquantization\n{fp8.HEADER}")
    quantize = fp8.run(device, rounds=args.rounds, compile=not args.no_compile, log=say)
    say(f"\nGEMMs\n{fp8_gemm.HEADER}")
    gemms = fp8_gemm.run(device, rounds=args.rounds, log=say)
    say(f"\ntwo Llama-3-8B MLP blocks, forward + backward\n{fp8_mlp.HEADER}")
    mlp = fp8_mlp.run(device, rounds=args.rounds, peers=args.peers, compile=not args.no_compile,
                      log=say)
    if args.json:
        from dataclasses import asdict
        with open(args.json, "w") as f:
            json.dump({"device": name, "quantize": [asdict(r) for r in quantize],
                       "gemms": fp8_gemm.rows_json(gemms), "mlp": fp8_mlp.rows_json(mlp)}, f,
                      indent=1)
    return 0


def _bench_memory(args, device: str, name: str) -> int:
    from fusedlayers.bench import memory as mem
    print(f"device: {name}\n{mem.HEADER}")
    rows = mem.run(device, tuple(args.memory_models.split(",")),
                   log=lambda line: print(line, flush=True))
    if args.json:
        mem.write_json(args.json, rows, name)
    return 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("info", "bench"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return info() if sys.argv[1] == "info" else bench(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
