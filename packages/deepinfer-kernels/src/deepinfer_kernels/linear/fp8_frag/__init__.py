"""FP8 block-scaled linear with the e4m3 codes decoded straight into the wgmma register operand (mode "frag" of
`deepinfer_kernels.linear.triton`; docs/linear_fp8_frag.md). The kernel lives in the `triton` submodule, imported by
the linear Triton backend only."""
