"""Lab 07 (formats): the floating-point formats of low-precision training, computed, not quoted:
fp32, tf32, fp16, bf16 and fp8 (e4m3, e5m2) from torch.finfo; where each rounds to zero; tf32
emulated on any CPU by rounding the fp32 mantissa to 10 bits, and its switches; running sums that
stop growing in low precision; which ops torch.autocast runs in low precision.

Run:  ./run.sh 07      (or: ./run.sh labs/lab07_formats.py)

Every rank prints nothing but rank 0: the formats table, the error of a matmul whose inputs are
rounded to tf32 and bf16, the output dtypes under autocast, and, on a GPU, the measured speed of
fp32, TF32 and bf16 matmuls (TF32 matmuls are off by default since PyTorch 1.12; since PyTorch 2.9
the switches are `torch.backends.cuda.matmul.fp32_precision` and
`torch.backends.cudnn.conv.fp32_precision`, "tf32" or "ieee").
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.show import format_table


# ---------------------------------------------------------------------------------------------
# Number formats
# ---------------------------------------------------------------------------------------------
FORMATS = {  # name -> dtype; tf32 has no torch dtype: it is a matmul mode of fp32 on Ampere+ GPUs
    "fp32": torch.float32, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2,
}
TF32_EXPONENT_BITS, TF32_MANTISSA_BITS = 8, 10  # NVIDIA's definition: fp32's range, fp16's precision


def format_info(name: str) -> dict:
    """Bits, range and precision of one format, computed from torch.finfo (tf32 from its definition).

    mantissa bits = -log2(eps) (eps = 2^-m is the gap between 1 and the next number), exponent bits =
    bits - 1 (sign) - mantissa bits; the smallest subnormal is smallest_normal * eps.
    """
    if name == "tf32":
        m, e = TF32_MANTISSA_BITS, TF32_EXPONENT_BITS
        bias = 2 ** (e - 1) - 1
        eps, smallest_normal = 2.0 ** -m, 2.0 ** (1 - bias)
        largest = (2.0 - eps) * 2.0 ** bias
        bits = 1 + e + m
    else:
        fi = torch.finfo(FORMATS[name])
        m = round(-math.log2(fi.eps))
        e = fi.bits - 1 - m
        bits, eps, smallest_normal, largest = fi.bits, fi.eps, fi.smallest_normal, fi.max
    return {"format": name, "bits": bits, "sign": 1, "exponent": e, "mantissa": m, "max": largest,
            "smallest normal": smallest_normal, "smallest subnormal": smallest_normal * eps,
            "zero at or below": smallest_normal * eps / 2,
            "eps": eps, "decimal digits": round((m + 1) * math.log10(2), 1)}


def underflow_threshold(dtype: torch.dtype) -> float:
    """The largest magnitude that rounds to zero in `dtype`: half the smallest subnormal.

    Round to nearest, ties to even: a value between half the smallest subnormal s and s rounds up
    to s; s / 2 itself is a tie between 0 and s and goes to the even one, 0. So fp16 (s = 2^-24)
    keeps 1.0001 * 2^-25 (as 2^-24) and loses 2^-25 and everything below it."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


def formats_table() -> list[dict]:
    return [format_info(name) for name in FORMATS]


def plot_bit_layout(ax=None):
    """One bar per format: sign, exponent and mantissa bits, to scale."""
    import matplotlib.pyplot as plt

    rows = formats_table()
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.2))
    colors = {"sign": "tab:red", "exponent": "tab:blue", "mantissa": "tab:green"}
    for y, row in enumerate(reversed(rows)):
        left = 0
        for part in ("sign", "exponent", "mantissa"):
            width = row[part]
            ax.barh(y, width, left=left, color=colors[part], edgecolor="white",
                    label=part if y == 0 else None)
            if width:
                ax.text(left + width / 2, y, str(width), ha="center", va="center", color="white", fontsize=9)
            left += width
    ax.set_yticks(range(len(rows)), [r["format"] for r in reversed(rows)])
    ax.set_xlabel("bits (most significant first)")
    ax.set_title("Bit layout: sign | exponent (range) | mantissa (precision)")
    ax.legend(loc="lower right", fontsize=8)
    ax.figure.tight_layout()
    return ax


ROUNDING_PROBES = {  # label -> value probed; each shows rounding, overflow or underflow
    "1 + eps(fp16)/2": 1 + 2.0 ** -11, "1 + eps(bf16)": 1 + 2.0 ** -7, "257": 257.0, "2049": 2049.0,
    "70000": 70000.0, "1e-6": 1e-6, "1e-8": 1e-8, "1e-40": 1e-40,
}


def rounding_examples() -> list[dict]:
    """Each probe value stored in each real format and read back: the value you actually get."""
    rows = []
    for label, value in ROUNDING_PROBES.items():
        row = {"value": label}
        for name, dtype in FORMATS.items():
            if dtype is not None:
                row[name] = torch.tensor(value, dtype=torch.float64).to(dtype).to(torch.float64).item()
        rows.append(row)
    return rows


def round_mantissa(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """Round fp32 values to `mantissa_bits` explicit mantissa bits, keeping fp32's exponent range.

    Emulates tf32 (10 bits) or bf16 (7 bits) on any CPU: round to nearest, ties to even, on the bit
    pattern. Adding half an ulp (plus the lowest kept bit, for ties-to-even) and clearing the dropped
    bits carries into the exponent when the mantissa overflows, as hardware rounding does.
    inf and nan are returned unchanged.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"round_mantissa expects float32, got {x.dtype}")
    if not 0 <= mantissa_bits <= 23:
        raise ValueError(f"mantissa_bits must be in 0..23, got {mantissa_bits}")
    drop = 23 - mantissa_bits
    if drop == 0:
        return x.clone()
    bits = x.contiguous().view(torch.int32).to(torch.int64)  # int64: the carry must not overflow
    lowest_kept = (bits >> drop) & 1
    rounded = (bits + (1 << (drop - 1)) - 1 + lowest_kept) & ~((1 << drop) - 1)
    out = rounded.to(torch.int32).view(torch.float32)  # wraps back to the int32 bit pattern
    return torch.where(torch.isfinite(x), out, x)


def has_fp32_precision_api() -> bool:
    """True on torch >= 2.9, whose TF32 switches are the `fp32_precision` attributes."""
    return getattr(torch.backends.cuda.matmul, "fp32_precision", None) is not None


def tf32_switches() -> dict[str, str]:
    """The current TF32 settings, read through the API this torch has.

    torch >= 2.9: `torch.backends.cuda.matmul.fp32_precision` and
    `torch.backends.cudnn.conv.fp32_precision` ("tf32": tensor cores may round fp32 inputs to 10
    mantissa bits; "ieee": full fp32; "none": not set here, the level above decides, up to the
    global `torch.backends.fp32_precision`; PyTorch pull request #125888).
    Older torch: `torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32` and
    `torch.get_float32_matmul_precision()`. Do not mix the two: once the new API has set a value,
    torch refuses to read the old flags (RuntimeError), so only one set is read here.
    """
    if has_fp32_precision_api():
        return {"torch.backends.fp32_precision": torch.backends.fp32_precision,
                "torch.backends.cuda.matmul.fp32_precision": torch.backends.cuda.matmul.fp32_precision,
                "torch.backends.cudnn.conv.fp32_precision": torch.backends.cudnn.conv.fp32_precision}
    return {"torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
            "torch.backends.cuda.matmul.allow_tf32": str(torch.backends.cuda.matmul.allow_tf32),
            "torch.backends.cudnn.allow_tf32": str(torch.backends.cudnn.allow_tf32)}


@contextlib.contextmanager
def matmul_tf32(enabled: bool) -> Iterator[None]:
    """fp32 matmuls with TF32 allowed (True) or in full fp32 (False), restored afterwards:
    `torch.backends.cuda.matmul.fp32_precision = "tf32" | "ieee"` on torch >= 2.9, else
    `torch.set_float32_matmul_precision("high" | "highest")`."""
    if has_fp32_precision_api():
        saved = torch.backends.cuda.matmul.fp32_precision
        torch.backends.cuda.matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            torch.backends.cuda.matmul.fp32_precision = saved
    else:
        saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(saved)


def running_sum(increment: float, steps: int, dtype: torch.dtype) -> list[float]:
    """s_k = s_(k-1) + increment for k = 1..steps, every partial sum stored in `dtype`, as a loop
    that accumulates into a low-precision tensor does (a gradient accumulated over micro-batches
    in bf16, a running loss, an EMA). Returns the partial sums.

    Once the increment is at most half a unit in the last place of the sum, s + increment rounds
    back to s and the sum stops growing: for increment 1, at 2^(mantissa bits + 1), 256 in bf16
    and 2048 in fp16. torch's own reductions (`tensor.sum()`) accumulate in fp32 internally."""
    total = torch.zeros((), dtype=dtype)
    step = torch.tensor(increment, dtype=dtype)
    sums = []
    for _ in range(steps):
        total = total + step
        sums.append(total.item())
    return sums


def stall_value(increment: float, dtype: torch.dtype) -> float:
    """Where running_sum(increment, ..., dtype) stops growing: the first sum s at which
    s + increment rounds back to s (for increment a power of two: increment * 2^(mantissa + 1))."""
    total, step = torch.zeros((), dtype=dtype), torch.tensor(increment, dtype=dtype)
    while (total + step) != total:
        total = total + step
    return total.item()


def matmul_errors(n: int, seed: int = 0) -> list[dict]:
    """Relative error of an n x n matmul whose inputs are rounded to each format (fp32 accumulate).

    This is how tensor cores run tf32 and bf16: inputs rounded, products accumulated in fp32. The
    reference is the float64 product of the same fp32 inputs.
    """
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    exact = a.double() @ b.double()

    def rel(c: torch.Tensor) -> float:
        return ((c.double() - exact).norm() / exact.norm()).item()

    rows = [("fp32", a @ b, "fp32 inputs, fp32 matmul")]
    for name, m in (("tf32 (emulated)", TF32_MANTISSA_BITS), ("bf16 (emulated)", 7)):
        rows.append((name, round_mantissa(a, m) @ round_mantissa(b, m),
                     f"inputs rounded to {m} mantissa bits, fp32 matmul"))
    rows.append(("bf16 (torch)", (a.bfloat16() @ b.bfloat16()).float(), "bf16 tensors, bf16 output"))
    return [{"inputs": name, "relative error": rel(c), "how": how} for name, c, how in rows]


def matmul_speed(device: torch.device, n: int = 4096, repeats: int = 10) -> list[dict]:
    """TFLOP/s of an n x n matmul on a GPU: fp32 with TF32 off ("ieee"), fp32 with TF32 allowed
    ("tf32"), and bf16 (`matmul_tf32`; the setting is restored afterwards)."""
    from helpers.bench import measure

    if device.type != "cuda":
        raise ValueError("matmul_speed measures tensor-core modes: it needs a CUDA device")
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    flops = 2 * n ** 3
    rows = []
    for label, tf32, dtype in (("fp32 (TF32 off)", False, torch.float32),
                               ("fp32 with TF32", True, torch.float32),
                               ("bf16", False, torch.bfloat16)):
        x, y = a.to(dtype), b.to(dtype)
        with matmul_tf32(tf32):
            t = measure(lambda: x @ y, device=device, warmup=3, repeats=repeats).median
        rows.append({"mode": label, "fp32 matmul precision": "tf32" if tf32 else "ieee",
                     "ms": 1e3 * t, "TFLOP/s": flops / t / 1e12})
    return rows


# ---------------------------------------------------------------------------------------------
# Autocast
# ---------------------------------------------------------------------------------------------
def autocast_ops(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> dict[str, Callable]:
    """Common ops on x (B, D) and an fp32 weight w (D, D); y (B,) class targets."""
    return {
        "linear": lambda: F.linear(x, w), "matmul": lambda: x @ w, "bmm": lambda: torch.bmm(x[None], w[None]),
        "conv1d": lambda: F.conv1d(x[None], w[:, :, None]), "add": lambda: x + x, "mul": lambda: x * x,
        "relu": lambda: F.relu(x), "gelu": lambda: F.gelu(x), "exp": lambda: torch.exp(x),
        "sum": lambda: x.sum(), "softmax": lambda: F.softmax(x, -1),
        "log_softmax": lambda: F.log_softmax(x, -1),
        "layer_norm": lambda: F.layer_norm(x, x.shape[-1:]), "mse_loss": lambda: F.mse_loss(x, x.detach()),
        "cross_entropy": lambda: F.cross_entropy(x, y), "x + fp32 tensor": lambda: x + w,
    }


def autocast_output_dtypes(device_type: str, dtype: torch.dtype, size: int = 8) -> list[dict]:
    """Output dtype of each op in `autocast_ops` under torch.autocast(device_type, dtype), once for
    an fp32 input x and once for an x already in `dtype` (e.g. the output of a linear layer)."""
    device = torch.device(device_type)
    x = torch.randn(size, size, device=device)
    w = torch.randn(size, size, device=device)
    y = torch.zeros(size, dtype=torch.long, device=device)
    short = lambda t: str(t.dtype).replace("torch.", "")
    low = short(x.to(dtype))
    rows = {}
    with torch.autocast(device_type, dtype=dtype):
        for name, op in autocast_ops(x, w, y).items():
            rows[name] = {"op": name, "fp32 input": short(op())}
        for name, op in autocast_ops(x.to(dtype), w, y).items():
            rows[name][f"{low} input"] = short(op())
    return list(rows.values())


@dataclass(frozen=True)
class Run(runs.Run):
    """The matmul whose rounding errors are measured (n x n), and the one timed on a GPU."""
    matmul_n: int = 1024
    speed_n: int = 8192
    SMOKE = dict(matmul_n=128, speed_n=2048)


def run(ctx: DistContext, cfg: Run) -> None:
    """Print (rank 0) and report the formats, tf32/bf16 matmul errors, autocast dtypes and, on a
    GPU, matmul speed with and without TF32."""
    ctx.print0(format_table(formats_table(), floatfmt=".4g"))
    n = cfg.matmul_n
    errors = matmul_errors(n)
    ctx.print0(f"\nrelative error of a {n} x {n} matmul, inputs rounded to each format:")
    ctx.print0(format_table(errors, floatfmt=".2e"))
    cpu_bf16 = autocast_output_dtypes("cpu", torch.bfloat16)
    ctx.print0("\noutput dtypes under torch.autocast('cpu', dtype=torch.bfloat16):")
    ctx.print0(format_table(cpu_bf16))
    speed = None
    if ctx.device.type == "cuda":
        speed = matmul_speed(ctx.device, n=cfg.speed_n)
        ctx.print0(f"\nmatmul speed on {ctx.device}:")
        ctx.print0(format_table(speed, floatfmt=".3g"))
    else:
        ctx.print0("\nno GPU for this rank: TF32 speed not measured (the TF32 switches do nothing on CPU)")
    stalls = {str(dtype).replace("torch.", ""): stall_value(1.0, dtype)
               for dtype in (torch.bfloat16, torch.float16)}
    ctx.print0(f"\na running sum of ones stops growing at: {stalls}")
    ctx.print0(f"TF32 switches: {tf32_switches()}")
    ctx.report(formats=formats_table(), matmul_errors=errors, autocast_cpu_bf16=cpu_bf16,
               matmul_speed=speed, running_sum_stalls=stalls, tf32_switches=tf32_switches())


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
