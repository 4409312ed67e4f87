"""Python against TorchScript for a run of small ops of the draft's sizes (896-wide rows, one token).

    python ops.py

Ten repeats of the pointwise part of a layer (RMSNorm, the rotary's two products, a roll, two
adds): 60 ops. The same function eagerly (as the lean forward runs it), in inference mode,
scripted (torch.jit.script) and traced (torch.jit.trace); medians of 2,000 calls."""

import statistics
import time

import torch

torch.set_num_threads(2)


def layer_parts(x, w, cos, sin):
    for _ in range(10):
        h = torch.nn.functional.rms_norm(x, (896,), w, 1e-6)
        x = x + (h * cos + h.roll(448, -1) * sin)
    return x


def median_us(call, repeats: int = 2000) -> float:
    for _ in range(100):
        call()
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
    return statistics.median(walls) * 1e6


def main() -> None:
    args = (torch.randn(1, 1, 896), torch.randn(896), torch.randn(1, 1, 896), torch.randn(1, 1, 896))
    scripted = torch.jit.script(layer_parts)
    traced = torch.jit.trace(layer_parts, args)
    print(f"torch {torch.__version__}, 2 threads, 60 ops a call")
    print(f"eager:                 {median_us(lambda: layer_parts(*args)):6.1f} us")
    with torch.inference_mode():
        for name, call in (
            ("eager, inference mode", layer_parts),
            ("scripted", scripted),
            ("traced", traced),
        ):
            print(f"{name + ':':22s} {median_us(lambda: call(*args)):6.1f} us")


if __name__ == "__main__":
    main()
