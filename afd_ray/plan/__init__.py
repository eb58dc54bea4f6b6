"""Profile a model and plan the A:F ratio against plain vLLM (`afd-ray profile`, `afd-ray plan`).

`schema` (the profile file), `probe` (one profiling vLLM engine in its own process),
`profile` (the CPU profile and the equal-resources verdict), `gpu` (the CUDA profile,
through the benchmark), `link` (the connector's latency and bandwidth), `model` (the
per-layer performance model, plain vLLM's at equal resources, and their sources),
`plan` (ranking the layouts, multi-GPU predictions, the one-GPU check), `report` (what
`afd-ray plan` prints and writes). Importing this package imports neither vLLM nor Ray.
"""
