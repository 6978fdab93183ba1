"""The CPU linear implementation: packed matmul panels, the fused decoder
stack and the greedy head (C++ kernels via XLA FFI)."""

# A step of at most this many tokens streams the weights once whatever its rows: it is
# bound by memory traffic and per-call overheads, not compute. The fused step, all
# layers per layerwise call, the decoder-stack kernel and the greedy head pay off there
# and only there (docs/benchmarks.md).
SMALL_STEP_TOKENS = 8
