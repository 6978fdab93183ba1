"""Checks and profilers that tests, CI and the README run, each `python -m
jaxserve.tools.<name>`: export_check (accelerator lowering from a CPU host), device_check
(kernels and the engine step on an accelerator), stress (the reliability suite behind
`make stress`), bench_startup, profile_step, profile_steps, profile_layer and trace_step.

Nothing in the serving path imports this package: stress_server's fault hooks must stay
out of reach of a normal `jaxserve serve`.
"""
