"""AWS Signature Version 4 for S3 GETs and PUTs: botocore's S3SigV4Auth headers, cheaper.

A cold small file is one GET, and botocore signs it through an AWSRequest,
a header dict copied several times and an HMAC chain from the secret down
to the day's key: about a tenth of the GET's CPU here. This signs the same
request (the method, the URL's path as is, its canonical query, every
header but User-Agent, Expect and X-Amzn-Trace-Id, plus Host, X-Amz-Date,
X-Amz-Content-SHA256 and, with temporary credentials,
X-Amz-Security-Token) with the day's signing key derived once per (secret,
day, region). X-Amz-Content-SHA256 is the empty body's hash (a GET), or
`UNSIGNED-PAYLOAD` (an upload's part: S3 takes it, and its CRC32 header
guards the bytes; hashing every byte for the signature cost more CPU than
the rest of an upload). tests/blockcache_client/sources/test_sigv4.py holds
it equal to botocore's signature.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlsplit

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
_UNSIGNED = frozenset({"expect", "user-agent", "x-amzn-trace-id"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_KEYS_KEPT = 16


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class SigV4:
    """Signs GETs; thread-safe (a dict of derived keys, replaced whole)."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str], bytes] = {}

    def _signing_key(self, secret: str, day: str, region: str) -> bytes:
        k = (secret, day, region)
        key = self._keys.get(k)
        if key is None:
            key = _hmac(_hmac(_hmac(_hmac(("AWS4" + secret).encode(), day), region), "s3"),
                        "aws4_request")
            keys = dict(self._keys) if len(self._keys) < _KEYS_KEPT else {}
            keys[k] = key
            self._keys = keys
        return key

    def sign(self, url: str, headers: dict[str, str], region: str, access_key: str,
             secret: str, token: str | None = None, now: float | None = None) -> dict[str, str]:
        """`headers` plus the signature's for a GET of `url` (no query)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
            host = f"{host}:{parts.port}"
        return self.sign_path(host, parts.path or "/", headers, region, access_key, secret,
                              token, now)

    def sign_path(self, host: str, path: str, headers: dict[str, str], region: str,
                  access_key: str, secret: str, token: str | None = None,
                  now: float | None = None, method: str = "GET", query: str = "",
                  payload: str = EMPTY_SHA256) -> dict[str, str]:
        """`sign` of a URL already split: `host` as the Host header has it
        (with a port other than the scheme's), `path` as sent, `query` in
        canonical form (names sorted, names and values URI-encoded), and
        `payload` the body's SHA-256 or UNSIGNED_PAYLOAD."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        out = dict(headers)
        out["X-Amz-Date"] = stamp
        out["X-Amz-Content-SHA256"] = payload
        if token:
            out["X-Amz-Security-Token"] = token
        signed = {k.lower(): " ".join(v.split()) for k, v in out.items()
                  if k.lower() not in _UNSIGNED}
        signed["host"] = host
        names = sorted(signed)
        canonical = "\n".join([method, path, query,
                               *(f"{n}:{signed[n]}" for n in names), "",
                               ";".join(names), payload])
        scope = f"{stamp[:8]}/{region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._signing_key(secret, stamp[:8], region), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
        return out
