"""What bench_layer.py (TensorFlow) and bench_layer_jax.py share: the rows and the CPU's name."""

import os
import platform

# name, shape, axis
SHAPES = [
    ("NHWC 64x32x32x64", (64, 32, 32, 64), -1),
    ("NCHW 64x64x32x32", (64, 64, 32, 32), 1),
    ("1024x1024", (1024, 1024), -1),
    ("seq 256x128x512", (256, 128, 512), -1),
]
SMOKE_SHAPES = [
    ("NHWC 4x4x4x8", (4, 4, 4, 8), -1),
    ("NCHW 4x8x4x4", (4, 8, 4, 4), 1),
    ("16x32", (16, 32), -1),
    ("seq 4x6x8", (4, 6, 8), -1),
]
POLICIES = ["float32", "mixed_float16"]


def cpu_description():
    """The CPU's model name (from /proc/cpuinfo where there is one) and its core count."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"
