"""Triton kernels for the GPU hot paths, each beside its pure-PyTorch reference.

Imported as `tlt.kernels` (never as top-level `kernels`: a PyPI package of that
name exists). Modules: `rmsnorm`, `rotary`, `paged_attention`, `tree_accept`;
each exposes one dispatch function that runs the Triton kernel on CUDA tensors
and the reference elsewhere (`launch.use_triton`). See kernels/README.md.
"""
