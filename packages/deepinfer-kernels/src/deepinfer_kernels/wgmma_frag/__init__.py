"""Shape helpers of the kernels that decode quantized weights straight into the wgmma register operand (the FP4
expert kernels, `moe.fp4_grouped`, and the FP8 linear's "frag" mode, `linear.fp8_frag`). Triton code in the `triton`
submodule."""
