"""`python -m fusedlayers info` reports which backends (torch extension, TensorFlow op library)
are built and usable, for which devices, and why not; `python -m fusedlayers bench` times fused against unfused ops (fusedlayers.bench)."""

import argparse
import importlib.util
import platform
import sys


def _torch_info() -> bool:
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed")
        return True
    import torch
    from fusedlayers.torch import ops
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    if ops._LOAD_ERROR is not None:
        print(f"  extension: not usable: {ops._LOAD_ERROR}")
        return False
    kernels = [key for key in ("CPU", "CUDA")
               if torch._C._dispatch_has_kernel_for_dispatch_key("fusedlayers::layer_norm", key)]
    print(f"  extension: loaded; kernels for {', '.join(kernels)}"
          + ("" if "CUDA" in kernels else " (built without CUDA kernels)"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i} {p.name} sm_{p.major}{p.minor}")
    return True


def _tensorflow_info() -> bool:
    if importlib.util.find_spec("tensorflow") is None:
        print("tensorflow: not installed")
        return True
    import tensorflow as tf
    from fusedlayers.tensorflow import ops
    print(f"tensorflow {tf.__version__}")
    if ops._LOAD_ERROR is not None:
        print(f"  op library: not usable: {ops._LOAD_ERROR}")
        return False
    print("  op library: loaded; kernels for CPU")
    return True


def info() -> int:
    import fusedlayers
    print(f"fusedlayers {fusedlayers.__version__}, Python {platform.python_version()}")
    ok = _torch_info()
    ok = _tensorflow_info() and ok
    return 0 if ok else 1


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedlayers bench")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--ops", default="relu_scale,layer_norm,linear_gelu",
                        help="comma-separated ops to bench")
    parser.add_argument("--quick", action="store_true", help="one shape per op")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG bar chart")
    args = parser.parse_args(argv)

    import torch
    from fusedlayers import bench as b
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    if device == "cpu":
        name += f" ({torch.get_num_threads()} threads)"
    rows, ceilings = b.run(device, tuple(args.dtypes.split(",")), args.quick,
                           not args.no_compile, args.reps, tuple(args.ops.split(",")))
    print(b.format_table(rows, ceilings, name))
    if args.json:
        b.write_json(args.json, rows, ceilings, name)
    if args.plot:
        b.plot(args.plot, rows, name)
    return 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("info", "bench"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return info() if sys.argv[1] == "info" else bench(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
