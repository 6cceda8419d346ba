"""What the daemon and the readers agree on: block keys (`blockkey`), the
sealed block file (`blockfile`), the cache dirs' layout (`layout`), the
socket protocol (`protocol`, `wire`), errors and size units.

These modules import nothing else of ours (an import-linter contract checks
it), so the daemon loads them without the reader, fsspec or botocore.
"""
