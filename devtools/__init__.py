"""Development tools for blockcache, not shipped with it: the `latency::`
fsspec file system (a remote some milliseconds away), `make demo`, and the
real processes (daemon, moto S3 server) that the tests and the benchmarks
both start.

`make setup` installs this folder into the project's .venv as its own
distribution (`blockcache-devtools`, devtools/pyproject.toml), which
registers `latency::` with fsspec for every process of that venv, fsclient
subprocesses included. Nothing under blockcache_client/, blockcached/ or
fsclient/ imports it (an import-linter contract checks that).
"""
