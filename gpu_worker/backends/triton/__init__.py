"""The Triton backend: paged attention and the K/V write as Triton kernels (interpreted on CPU)."""
