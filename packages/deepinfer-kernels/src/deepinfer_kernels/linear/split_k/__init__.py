"""The split-K epilogue shared by the linear Triton kernels (`triton` submodule: `write_tile`)."""
