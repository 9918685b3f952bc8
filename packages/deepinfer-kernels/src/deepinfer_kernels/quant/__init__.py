"""Checkpoint number formats: FP8 e4m3 block scales, FP4 e2m1 packed experts, E8M0 scales (torch references).

Exact decoders used by the torch references of `linear` and `moe` (weights stay quantized in memory; the
references dequantize per call), the dynamic FP8 activation quantizer, and the inverse weight quantizers of the
random-checkpoint writer. The deployed
KV-cache record formats (MXFP8 / NVFP4 / MXFP4 rows) live in ``deepinfer_kernels.quant.kv_formats``.
"""

from deepinfer_kernels.quant.kv_formats import (
    KV_FORMATS,
    MXFP4_E2M1,
    MXFP8_E4M3,
    NVFP4_E2M1,
    KVFormat,
)
from deepinfer_kernels.quant.reference import (
    E2M1_VALUES,
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    act_quant_fp8,
    dequant_fp4,
    dequant_fp8_block,
    e2m1_lut,
    e8m0_to_float,
    fake_quant_act_fp8,
    float_to_e8m0,
    pack_fp4,
    pow2_ceil_scale,
    quant_fp4,
    quant_fp8_block,
    unpack_fp4,
)

__all__ = [
    "E2M1_VALUES",
    "KV_FORMATS",
    "MXFP4_E2M1",
    "MXFP8_E4M3",
    "NVFP4_E2M1",
    "KVFormat",
    "FP4_E2M1_MAX",
    "FP8_E4M3_MAX",
    "act_quant_fp8",
    "dequant_fp4",
    "dequant_fp8_block",
    "e2m1_lut",
    "e8m0_to_float",
    "fake_quant_act_fp8",
    "float_to_e8m0",
    "pack_fp4",
    "pow2_ceil_scale",
    "quant_fp4",
    "quant_fp8_block",
    "unpack_fp4",
]
