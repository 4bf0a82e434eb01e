"""MXFP4 expert weights of the released GPT-OSS checkpoints, dequantized on load.

openai/gpt-oss-20b / 120b store each MoE layer's `mlp.experts.gate_up_proj` and `down_proj` as
`*_blocks` (uint8 [E, out, G, 16]: 32 FP4 E2M1 values per block of the input dimension, the low
nibble first) and `*_scales` (uint8 [E, out, G]: one E8M0 power-of-two scale per block, bias
127), with `quantization_config.quant_method == "mxfp4"` in config.json. The dequantized tensor
is transformers' `[E, in, out]` parameter (`integrations/mxfp4.py`, `convert_moe_packed_tensors`):
`value * 2 ** (scale - 127)`, exact in f32 and bf16 (the FP4 values have 2 significant bits).

Loading dequantizes to the model's param dtype (`dequantizing_reader`); saving writes the
dequantized weights without a quantization_config (`hf.save_pretrained`), as transformers does
for a model loaded with `Mxfp4Config(dequantize=True)`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The 16 FP4 (E2M1) values by code: sign bit 3, then exponent and mantissa.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# Both values of every byte: [256, 2] (low nibble, high nibble), one gather per byte.
BYTE_VALUES = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], -1)
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """blocks uint8 [E, out, G, B], scales uint8 [E, out, G] -> [E, in, out] in `dtype` with
    in = G * 2B (transformers' `convert_moe_packed_tensors`). One expert at a time, so the
    temporaries stay one expert's size."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match (blocks must be "
            "scales' shape plus a trailing byte axis)."
        )
    if blocks.ndim != 4:
        raise ValueError(f"MXFP4 expert blocks must be [E, out, G, B]; got {blocks.shape}.")
    experts, rows, groups, width = blocks.shape
    out = np.empty((experts, groups * 2 * width, rows), dtype)
    for e in range(experts):
        values = BYTE_VALUES[blocks[e]]  # [rows, G, B, 2]: the low nibble first
        # torch.ldexp(x, e) = x * 2.0 ** e, the power in f32 (2 ** 128 is inf there too).
        with np.errstate(over="ignore"):
            factor = np.exp2((scales[e].astype(np.int32) - 127).astype(np.float32))
        values *= factor[..., None, None]
        out[e] = values.reshape(rows, groups * 2 * width).T.astype(dtype)
    return out


def is_mxfp4(hf_config: Any) -> bool:
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    return str(method) == "mxfp4"


class DequantizingReader:
    """A `CheckpointReader` whose MXFP4 pairs (`X_blocks`, `X_scales`) read as one dequantized
    tensor `X`; every other key passes through."""

    def __init__(self, reader: Any, dtype: Any):
        self.reader = reader
        self.dtype = np.dtype(dtype)
        keys = reader.keys()
        self.packed = {
            k.removesuffix("_blocks")
            for k in keys
            if k.endswith("_blocks") and k.removesuffix("_blocks") + "_scales" in reader
        }
        hidden = {p + s for p in self.packed for s in SUFFIXES}
        self._keys = [k for k in keys if k not in hidden] + sorted(self.packed)

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        if key in self.packed:
            return True
        hidden = any(key.removesuffix(s) in self.packed for s in SUFFIXES if key.endswith(s))
        return key in self.reader and not hidden

    def get(self, key: str) -> np.ndarray:
        if key in self.packed:
            return dequantize(
                self.reader.get(key + "_blocks"), self.reader.get(key + "_scales"), self.dtype
            )
        return self.reader.get(key)


def dequantizing_reader(reader: Any, hf_config: Any, dtype: Any) -> Any:
    """`reader` itself, or for an MXFP4 checkpoint a `DequantizingReader` (to `dtype`) over it."""
    return DequantizingReader(reader, dtype) if is_mxfp4(hf_config) else reader


__all__ = ["FP4_VALUES", "DequantizingReader", "dequantize", "dequantizing_reader", "is_mxfp4"]
