"""Profile a colocated model and plan the A:F ratio (`afd-ray profile`, `afd-ray plan`).

`schema` (the profile file), `profile` (vLLM + forward hooks on CPU, or the GPU
benchmark's JSON), `link` (the connector's latency and bandwidth), `model` (the
per-layer performance model and its sources), `plan` (ranking the layouts). Importing
this package imports neither vLLM nor Ray.
"""
