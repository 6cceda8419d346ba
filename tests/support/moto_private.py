"""moto's S3 server answering an unsigned request 403 AccessDenied, as S3 does
for a private bucket (moto, with authentication on, fails it with a 500: a
missing Authorization header is a KeyError there, which clients retry).

    python -m tests.support.moto_private -H 127.0.0.1 -p PORT   # moto.server's arguments
"""

from __future__ import annotations

import sys

from moto.iam.access_control import S3IAMRequest
from moto.s3.exceptions import S3AccessDeniedError
from moto.server import main

_checked = S3IAMRequest.__init__


def _unsigned_denied(self: S3IAMRequest, *args, **kwargs) -> None:
    headers = kwargs["headers"]  # moto passes every argument by name
    if "Authorization" not in headers:
        raise S3AccessDeniedError()
    _checked(self, *args, **kwargs)


S3IAMRequest.__init__ = _unsigned_denied

if __name__ == "__main__":
    sys.exit(main())
