"""moto's S3 server whose ranged GETs copy their range only, as real S3's cost does.

    python -m bench.moto_ranges -H 127.0.0.1 -p PORT     # moto.server's arguments

moto reads a whole object out of its buffer for every GET (`FakeKey.value`)
and slices the range from that copy, so an 8 MiB part of a 1 GiB object costs
a 1 GiB copy, and a client with many parts in flight (the CRT client: tens)
holds that many copies at once. Here an object's bytes are read out once and
kept (immutable) until the object is written again, so each GET costs only
its range's copy. `bench.large_files` uses it for every system alike.
"""

from __future__ import annotations

import sys

from moto.s3.models import FakeKey
from moto.server import main

_plain = FakeKey.value


def _get(self: FakeKey) -> bytes:
    kept = self.__dict__.get("_whole_value")
    if kept is None:
        kept = self.__dict__["_whole_value"] = _plain.fget(self)
    return kept


def _set(self: FakeKey, new_value) -> None:
    self.__dict__.pop("_whole_value", None)
    _plain.fset(self, new_value)


FakeKey.value = property(_get, _set)

if __name__ == "__main__":
    sys.exit(main())
