"""Benchmarks outside the engine's own `jaxserve bench`: jaxserve against its peers
(llama.cpp, transformers) and feature-against-feature comparisons (prefix cache,
speculative decoding, quantization quality and speed, P/D disaggregation, DP processes,
structured outputs on the device, KV transfer encodings, scheduler defaults).

Run from the repository root, each as a module so that the shared helper
(benchmarks/harness.py: servers on loopback, timing them, building llama.cpp) imports as
part of the package:

    .venv/bin/python -m benchmarks.vs_llamacpp --json out.json
    .venv/bin/python -m benchmarks.vs_hf
    .venv/bin/python -m benchmarks.harness build
"""
