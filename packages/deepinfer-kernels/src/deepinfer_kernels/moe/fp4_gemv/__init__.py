"""FP4 routed-expert GEMVs on the CUDA cores for decode token counts (config variants "gemv" / "gemv_expert" of
`deepinfer_kernels.moe.triton`). The kernels live in the `triton` submodule, imported by the MoE Triton backend
only."""
