"""Argument helpers shared by the glm5-lab subcommands."""
from __future__ import annotations

import argparse


class UsageError(ValueError):
    """A bad argument found after parsing (it needs the model or the machine to
    judge): cli.main reports it like argparse does, usage line and exit 2."""


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def nonnegative_int(text: str) -> int:
    return 0 if text.strip() == "0" else positive_int(text)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v


def lengths(text: str) -> list:
    """'512,1024,2048' -> [512, 1024, 2048]: at least two, increasing."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sequence lengths like 512,1024,2048, "
                                         f"got {text!r}") from None
    if len(values) < 2 or any(v <= 0 for v in values) or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"expected at least two increasing positive lengths, got {text!r}")
    return values


def add_quantization_arg(p) -> None:
    from models.glm5.quantization import MODES

    p.add_argument("--quantization", choices=MODES,
                   help="int8 weights with the key layers kept (models.glm5.quantize, DEFAULT_SKIP; docs/INT8.md); "
                        "CPU, or CUDA with the extension's CUDA kernels")


def check_quantization(args, device) -> None:
    """The int8 ops have CPU kernels and CUDA kernels (when glm5_ops._C was built
    with them): another device is a usage error before the model is built, not a
    NotImplementedError at its first forward."""
    if not getattr(args, "quantization", None) or device.type == "cpu":
        return
    from glm5_ops import _backend
    if device.type != "cuda":
        raise UsageError(f"--quantization {args.quantization}: the int8 kernels run on the CPU and CUDA, "
                         f"got device {device.type}")
    if not getattr(_backend._C, "WITH_CUDA", 0):
        raise UsageError(f"--quantization {args.quantization}: glm5_ops._C was built without its CUDA kernels "
                         "(rebuild with nvcc present: pip install --no-build-isolation -e .)")


def quantize_for(args, model, device):
    """Applies --quantization to the built model (in place) and returns its mode
    (None: float; a checkpoint saved quantised reports its own)."""
    from models.glm5 import ensure_quantized

    check_quantization(args, device)
    try:
        return ensure_quantized(model, args.quantization)
    except ValueError as e:
        raise UsageError(f"--quantization: {e}") from None
