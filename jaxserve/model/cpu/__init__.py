"""The CPU linear implementation: packed matmul panels, the fused decoder
stack and the greedy head (C++ kernels via XLA FFI)."""
