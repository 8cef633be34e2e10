"""Everything CPU-specific in the worker: the CPU kind (kind.py), the C kernels (kernels.py), the
matmul path per row count (matmul.py) and the one entry point that readies a model for a CPU
(backend.py). Model files know none of it."""
