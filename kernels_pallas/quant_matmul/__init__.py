"""Weight-only quantized matmul for the decode buckets on TPU (Mosaic) and CUDA (Triton):
int8 weights and their scales are read into VMEM / shared memory and widened there, so
the dequantized matrix never exists in HBM (kernel.py; tuning data: tuning.py; the
jnp reference: ref.py)."""
