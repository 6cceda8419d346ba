"""Benchmarks: scripts that print measured figures against targets and peers.

Run each as a module, e.g. `python -m bench.daemon`. Nothing here is a test;
speed lives here, correctness in tests/.
"""
