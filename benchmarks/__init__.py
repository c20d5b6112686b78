"""The lab, not installed: launch-variant sweeps, Nsight Compute cases, the GPU run script and its helpers.

Run from the repository root (`python -m benchmarks.sweep`, `bash benchmarks/gpu_run.sh STEP`); the package's
`glm5next bench` and `glm5next tune-policy` measure what ships.
"""
