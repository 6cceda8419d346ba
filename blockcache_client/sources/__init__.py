"""The remote a volume reads: `backend` (any fsspec file system: listing,
stat, ranged reads, retries), `s3direct` (S3 GETs on the reader's own thread,
bypassing fsspec's event loop), `parts` (a range cut into parallel parts) and
`fileinfo` (a file's size, version and kind as the reader keys blocks by).

Nothing here knows the daemon or the cache: an import-linter contract keeps
`sources` from importing `reader` or `daemonclient`.
"""
