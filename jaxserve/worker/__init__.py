"""The worker: the model runner (owns the device arrays, decides nothing),
step programs, step inputs, packing, buckets, device KV sizing, the
compile cache and the device drafters."""
