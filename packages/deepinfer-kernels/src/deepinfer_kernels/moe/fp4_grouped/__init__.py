"""FP4 routed-expert GEMMs decoded per 32-column scale group straight into the tensor-core operand registers (config
variants "grouped", "grouped_exact", "grouped_bits" of `deepinfer_kernels.moe.triton`; docs/moe_fp4_kernel.md).
The kernels live in the `triton` submodule, imported by the MoE Triton backend only."""
