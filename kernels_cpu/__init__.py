"""CPU kernels for jaxserve, compiled on first use and called through XLA's FFI."""
