"""Benchmarks, run from the repository root as modules: `python -m bench.engine_throughput`.

A package so that the benchmarks import one another (`from bench.engine_throughput import
cpu_model`) without editing sys.path. Keep this file empty of imports: bench.gpu must set
TRITON_INTERPRET before anything imports a kernel module.
"""
