"""MXFP4 (OCP Microscaling, 4-bit e2m1 values sharing an 8-bit power-of-two scale per 32) as
gpt-oss publishes its experts: `*_blocks` [E, rows, groups, 16] uint8, two values a byte (low
nibble first), and `*_scales` [E, rows, groups] uint8, each a biased exponent (127 = 2^0).

Dequantized as transformers does on load (integrations/mxfp4.py): each value times 2^(scale -
127), the groups joined along a row, then the last two axes swapped, since the published rows are
the projection's outputs and the dequantized tensor is [E, in, out] (`gate_up_proj`, `down_proj`).
Every such value is exact in bfloat16 and float32.
"""

from __future__ import annotations

import numpy as np

# The e2m1 code points: sign bit 3, then two exponent bits and one mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SCALE_BIAS = 127
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 tensor [E, in, out] of MXFP4 `blocks` [E, out, G, B] and `scales` [E, out, G]."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair up")
    blocks = blocks.astype(np.uint8)
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [..., G, B, 2]
    values = np.ldexp(values.reshape(*scales.shape, -1), scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)


def quantized_name(name: str) -> tuple[str, str] | None:
    """(the dequantized tensor's name, "_blocks" or "_scales") for a published MXFP4 part, else None."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return None
