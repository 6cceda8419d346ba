"""Benchmarks: scripts that print measured figures against targets and peers.

- `python -m bench`: the suite, every system on the same data (docs/benchmarks.md).
  Its parts: `datasets`, `remote` (S3 server + latency proxy), `systems`,
  `workloads`, `worker` (reader processes), `access_paths` (how a worker reads
  through each system), `report`; `passthrough` is the minimal FUSE fs it
  compares with.
- Workloads of our own beside the suite: `python -m bench capacity` (the
  daemon's hit ratios; `python -m bench.policy_sim` runs its scenarios on
  the engine in-process at up to 200,000 blocks), `python -m bench prefetch`
  (cold epochs with and without `prefetch_ahead`).
- `python -m bench.leases`: cold readers of one file across two mounts, the
  remote's bytes with fetch leases and without.
- Standalone benchmarks of one component: `python -m bench.daemon_ops`
  (blockcached's lookups, puts, rebuild), `python -m bench.fuse_vs_passthrough`
  (fsclient in a fresh mount), `python -m bench.volume_vs_fsspec` (the `Volume`
  reader and its hit path against fsspec's caches).

Nothing here is a test; speed lives here, correctness in tests/.
"""

import os

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
