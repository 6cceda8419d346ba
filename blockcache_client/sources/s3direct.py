"""Ranged S3 GETs, and upload PUTs, on the calling thread, without aiobotocore.

A cold read of a small file is one GetObject. Through s3fs that GET costs
about twice the CPU (aiobotocore's request pipeline on fsspec's event-loop
thread, plus the hand-off to and from that thread) of one signed here with
botocore's SigV4 and sent on a plain socket. On a host whose cores also decode
and augment the samples, that CPU is what a cold epoch waits for.

What it takes from the s3fs filesystem: its options only (key, secret,
token, anon, endpoint_url, client_kwargs, config_kwargs, session kwargs such
as a profile). From them it builds a plain botocore client, used for three
things and never for a request: the credentials (botocore refreshes
temporary ones as they near expiry), the signing region, and each bucket's
URL (resolved once per bucket by presigning a probe key, so addressing
style, region endpoints and custom endpoints follow botocore's own rules).
Every GET is then one request with Range (and If-Match for a versioned
read), signed with SigV4 (`sigv4`: botocore's signature without botocore's
per-request objects) and sent on a kept-alive socket (`http1`: a third of
urllib3's CPU per GET). awscrt's S3Client was measured against it on the
same server and cost more CPU per GET of a small file (1.1 ms against
0.7-0.8 ms with signing), handing its body over as new bytes per chunk; and
per MiB of 8 MiB ranged GETs (1.4-2.6 ms against 0.3-0.7 ms, both landing in
a reused buffer): parts are received here straight into the caller's
buffers (`common.bufferpool`), where awscrt's chunks would be copied.

An upload's bulk (PutObject, UploadPart: `put`) goes the same way, signed
with UNSIGNED-PAYLOAD and guarded by an x-amz-checksum-crc32 header that S3
checks: aiobotocore hashed every byte for the signature (SHA-256 over plain
HTTP), and copied and checksummed it again, about 2.9 s of CPU per GiB
against 0.5 here (tests: tests/blockcache_client/sources/test_s3direct.py).
The few requests around the bulk (creating, completing, aborting an upload)
stay with s3fs.

It stays out of the way where s3fs does more than a plain GET: version-aware
filesystems, requester-pays, extra request arguments (SSE-C keys), HTTP
proxies, and a client botocore cannot build from the options. Those volumes
use s3fs for every request. A redirect or 400 naming the bucket's region
(`x-amz-bucket-region`, S3's answer to a request addressed or signed for
another region) is followed: the bucket is addressed and signed in that
region from then on. Any other answer it does not expect comes back as
`Declined`: the caller repeats the request through s3fs, which gives the
error (or the redirect handling) s3fs users know; another redirect or 400
also switches it off for good.
"""

from __future__ import annotations

import base64
import copy
import errno
import logging
import os
import ssl
import threading
import urllib.request
import zlib
from email.utils import parsedate_to_datetime
from typing import NoReturn
from urllib.parse import quote, urlsplit

from ..common.bufferpool import BufferPool
from .fileinfo import mtime_ns_of
from .http1 import Connections
from .parts import read_parts
from .sigv4 import UNSIGNED_PAYLOAD, SigV4

log = logging.getLogger(__name__)

_PROBE_KEY = "blockcache-probe"
USER_AGENT = "blockcache-s3direct"  # how S3 access logs tell these GETs apart
# answers that say "asking again later may work"
_TEMPORARY = frozenset({429, 500, 502, 503, 504})
_ERROR_BODY = 64 << 10  # read off an error answer to keep its connection; longer: closed


class Declined(Exception):
    """The direct path will not answer this request: repeat it through s3fs.
    `permanent`: it will not answer any other request of this volume either."""

    def __init__(self, why: str, permanent: bool):
        super().__init__(why)
        self.permanent = permanent


class _Moved(Exception):
    """S3 says the bucket is in another region (`x-amz-bucket-region`)."""

    def __init__(self, region: str):
        super().__init__(region)
        self.region = region


class TemporaryS3Error(OSError):
    """S3 answered a status worth retrying (throttling, 5xx)."""


def switched_on() -> bool:
    """False when the environment says every GET goes through s3fs
    (`BLOCKCACHE_S3_DIRECT=0`)."""
    return os.environ.get("BLOCKCACHE_S3_DIRECT", "1") != "0"


def direct_reader(fs, timeout: float, pool_size: int) -> DirectS3 | None:
    """A `DirectS3` for this s3fs filesystem, or None where it must not (or
    cannot) stand in for s3fs's own GET (see the module docstring)."""
    why = _ineligible(fs)
    if why is None:
        try:
            return DirectS3(fs, timeout, pool_size)
        except Exception as exc:  # noqa: BLE001 - any failure: s3fs does the GETs
            why = f"cannot build a botocore client from its options ({exc})"
    log.info("s3 GETs of this volume go through s3fs: %s", why)
    return None


def _ineligible(fs) -> str | None:
    if getattr(fs, "version_aware", False):
        return "the filesystem is version-aware"
    if getattr(fs, "req_kw", None):
        return "requester-pays requests"
    if getattr(fs, "s3_additional_kwargs", None):
        return "extra request arguments (s3_additional_kwargs)"
    if (getattr(fs, "config_kwargs", None) or {}).get("proxies"):
        return "an HTTP proxy in config_kwargs"
    if any(k in urllib.request.getproxies() for k in ("http", "https")):
        return "an HTTP proxy in the environment"
    return None


class DirectS3:
    """Signs and sends ranged GetObject requests for one s3fs filesystem's
    options. Thread-safe; one per process (rebuilt after fork by its owner)."""

    def __init__(self, fs, timeout: float, pool_size: int):
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config
        from botocore.credentials import Credentials

        client_kwargs = dict(fs.client_kwargs)
        config_kwargs = dict(fs.config_kwargs)
        init = {"aws_access_key_id": fs.key, "aws_secret_access_key": fs.secret,
                "aws_session_token": fs.token, "endpoint_url": fs.endpoint_url}
        init = {k: v for k, v in init.items() if v is not None and k not in client_kwargs}
        if fs.anon:
            for name in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
                init.pop(name, None)
                client_kwargs.pop(name, None)
            config_kwargs["signature_version"] = UNSIGNED
        if "use_ssl" not in client_kwargs:
            init["use_ssl"] = fs.use_ssl
        session = botocore.session.Session(**fs.kwargs)
        config = Config(**config_kwargs)

        def client_in(region: str | None):
            kw = dict(client_kwargs, region_name=region) if region else client_kwargs
            return session.create_client("s3", config=config, **init, **kw)
        self._client_in = client_in
        client = client_in(None)
        self._region = client.meta.region_name or "us-east-1"
        self._clients = {self._region: client}  # by region: where buckets are addressed
        if fs.anon:
            self._credentials = None
        else:
            key = client_kwargs.get("aws_access_key_id", fs.key)
            secret = client_kwargs.get("aws_secret_access_key", fs.secret)
            token = client_kwargs.get("aws_session_token", fs.token)
            self._credentials = (Credentials(key, secret, token) if key and secret
                                 else session.get_credentials())
            if self._credentials is None:
                raise ValueError("no credentials found (and the filesystem is not anon)")
        verify = client_kwargs.get("verify")
        if verify is None:
            verify = session.get_config_variable("ca_bundle") or True
        if verify is False:
            tls = ssl.create_default_context()
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        else:
            from botocore.httpsession import get_cert_path
            tls = ssl.create_default_context(cafile=get_cert_path(verify))
        self._pool_args = (timeout, pool_size, tls)
        self._http = Connections(*self._pool_args)
        # bucket: (scheme, host, port, Host header, path its keys follow, region)
        self._bases: dict[str, tuple[str, str, int, str, str, str]] = {}
        self._lock = threading.Lock()
        self._signer = SigV4()  # botocore's signature, at a fraction of its CPU

    def for_child(self) -> DirectS3:
        """This reader for a forked child: the same botocore client and
        credentials (no sockets in them), its own connections."""
        child = copy.copy(self)
        child._http = Connections(*self._pool_args)
        child._bases = dict(self._bases)
        child._lock = threading.Lock()
        return child

    def _base(self, bucket: str, region: str | None = None) -> tuple:
        """(scheme, host, port, Host header, the path a key of `bucket` is
        appended to, the region to sign for), as botocore addresses the
        bucket from a client in `region` (the client's own region until S3
        names another)."""
        found = self._bases.get(bucket)
        if found is not None and (region is None or found[5] == region):
            return found
        region = region or self._region
        with self._lock:
            client = self._clients.get(region)
            if client is None:
                client = self._clients[region] = self._client_in(region)
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": _PROBE_KEY}, ExpiresIn=60)
        path_end = url.split("?", 1)[0]
        if not path_end.endswith("/" + _PROBE_KEY):
            raise Declined(f"botocore addresses keys of {bucket} as {url!r}", True)
        parts = urlsplit(path_end[:-len(_PROBE_KEY)])
        default = 443 if parts.scheme == "https" else 80
        port = parts.port or default
        host = parts.hostname or ""
        found = (parts.scheme, host, port, host if port == default else f"{host}:{port}",
                 parts.path, region)
        with self._lock:
            self._bases[bucket] = found
        return found

    def get(self, bucket: str, key: str, start: int, end: int, if_match: str | None,
            piece: int, buffers: BufferPool | None = None,
            head: dict[str, str] | None = None) -> list[bytes] | None:
        """Bytes [start, end) of s3://bucket/key (fewer only at the end of the
        object) in `piece`-byte parts; None if `if_match` is given and the
        object's ETag is no longer it (412). `buffers` (of `piece` bytes):
        each part is received into one of them and is a read-only view of it.
        `head`: filled with the answer's headers (lower-case names), whose
        ETag, Content-Range and Last-Modified describe the version read
        (`first`)."""
        if end <= start:
            return []
        headers = {"Range": f"bytes={start}-{end - 1}", "User-Agent": USER_AGENT}
        if if_match is not None:
            headers["If-Match"] = f'"{if_match}"'

        def answer(resp, region: str) -> list[bytes] | None:
            if head is not None:
                head.update(resp.headers)
            return self._answer(resp, region, bucket, key, start, end, if_match, piece, buffers)
        return self._exchange("GET", bucket, key, headers, answer)

    def _exchange(self, method: str, bucket: str, key: str, headers: dict[str, str], answer,
                  query: str = "", body: memoryview | None = None, payload: str | None = None):
        """One request, signed and sent, and `answer(response, region)`; once
        more in the region S3 names if it says the bucket is elsewhere."""
        path = quote(key, safe="/~")
        base = self._base(bucket)
        for _ in range(2):
            scheme, host, port, netloc, prefix, region = base
            target = prefix + path
            signed = headers
            if self._credentials is not None:
                creds = self._credentials.get_frozen_credentials()
                signed = self._signer.sign_path(netloc, target, headers, region,
                                                creds.access_key, creds.secret_key, creds.token,
                                                method=method, query=query,
                                                **({"payload": payload} if payload else {}))
            try:
                resp = self._http.send(method, scheme, host, port,
                                       f"{target}?{query}" if query else target, signed, body)
                return answer(resp, region)
            except _Moved as moved:  # the bucket is in another region: address it there
                log.info("s3://%s is in %s, not %s: requests go there", bucket, moved.region,
                         region)
                base = self._base(bucket, moved.region)
            except TimeoutError as exc:  # the caller's retry loop knows this one
                raise TimeoutError(errno.ETIMEDOUT, f"{method} s3://{bucket}/{key}: "
                                                    f"{exc}") from None
        raise Declined(f"s3://{bucket} moved again after a redirect to {region}", True)

    def put(self, bucket: str, key: str, body: memoryview,
            query: dict[str, str] | None = None) -> str:
        """PUT `body` as s3://bucket/key (a PutObject), or with `query`
        (partNumber, uploadId) as a part of a multipart upload; the ETag
        S3 answered. Errors as `get`'s: FileNotFoundError, PermissionError,
        TemporaryS3Error (worth a retry), Declined (s3fs should ask)."""
        canonical = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                             for k, v in sorted((query or {}).items()))
        crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
        headers = {"Content-Length": str(len(body)), "x-amz-checksum-crc32": crc,
                   "User-Agent": USER_AGENT}
        return self._exchange("PUT", bucket, key, headers,
                              lambda resp, region: self._put_answer(resp, region, bucket, key),
                              canonical, body, UNSIGNED_PAYLOAD)

    def _put_answer(self, resp, region: str, bucket: str, key: str) -> str:
        """A PUT's ETag, or the error its answer means."""
        try:
            status = resp.status
            if 0 <= resp.length <= _ERROR_BODY:  # (an empty body, or an error's XML)
                resp.read(resp.length)
            etag = resp.headers.get("etag", "").strip('"')
            if status == 200 and etag:
                return etag
            # a 400 here is about the request (a part too small...): s3fs says so
            _refused(resp, region, f"a PUT of s3://{bucket}/{key}", bad_request_declines=False)
        finally:
            resp.release()

    def first(self, bucket: str, key: str, end: int) -> tuple[bytes, str, int, int] | None:
        """Bytes [0, end) of s3://bucket/key (fewer only at its end) and the
        version they are: (bytes, ETag, the object's size, its mtime_ns),
        all from one answer; None if the answer does not tell them."""
        head: dict[str, str] = {}
        data = b"".join(self.get(bucket, key, 0, end, None, end, None, head))
        found = _answer_version(head, len(data))
        if found is None or len(data) != min(end, found[1]):
            return None
        return (data, *found)

    def _answer(self, resp, region: str, bucket: str, key: str, start: int, end: int,
                if_match: str | None, piece: int,
                buffers: BufferPool | None) -> list[bytes] | None:
        """The parts of a GET's answer, None for a 412, or the error it means."""
        try:
            status = resp.status
            if not resp.body_known and status in (200, 206):
                raise Declined(f"an answer to a GET of s3://{bucket}/{key} without "
                               f"Content-Length", False)
            if status == 206 or (status == 200 and start == 0 and resp.length <= end - start):
                if status == 206:
                    first = (resp.headers.get("content-range") or "").partition("-")[0]
                    if first != f"bytes {start}":
                        raise Declined(f"a 206 for bytes={start}- came with Content-Range "
                                       f"{resp.headers.get('content-range')!r}", True)
                # a 200 is the whole object, no longer than asked
                return _read_parts(resp, end - start, piece, buffers)
            if 0 <= resp.length <= _ERROR_BODY:  # an error's body: a short XML document
                resp.read(resp.length)
            if status == 412 and if_match is not None:
                return None
            _refused(resp, region, f"a GET of s3://{bucket}/{key}", bad_request_declines=True)
        finally:
            resp.release()  # kept for the next GET only if its body was read whole


def _refused(resp, region: str, what: str, bad_request_declines: bool) -> NoReturn:
    """Raise the error an answer other than the one asked for means (its body
    read, if short): not found, access denied, worth a retry, the bucket in
    another region, or Declined: s3fs should ask. Any other redirect (and a
    400, for a GET: another addressing than the client's, which s3fs's own
    client follows) declines for good; a 416 or anything else: s3fs's error
    for it is the one to raise."""
    status = resp.status
    if status == 404:
        raise FileNotFoundError(f"not found (HTTP 404): {what}")
    if status == 403:
        raise PermissionError(f"access denied (HTTP 403): {what}")
    if status in _TEMPORARY:
        raise TemporaryS3Error(f"S3 answered HTTP {status} to {what}")
    moved_to = resp.headers.get("x-amz-bucket-region")
    if status in (301, 307, 400) and moved_to and moved_to != region:
        raise _Moved(moved_to)
    raise Declined(f"HTTP {status} to {what}",
                   permanent=300 <= status < 400 or (bad_request_declines and status == 400))


def _answer_version(head: dict[str, str], got: int) -> tuple[str, int, int] | None:
    """(ETag, the object's size, its mtime_ns) from the headers of a GET's
    200 or 206 answer (`got`: the body's length), or None if they do not
    say (no ETag, an unreadable Content-Range): what a HEAD would have told,
    for the same version as the bytes."""
    etag = head.get("etag", "").strip('"')
    if not etag:
        return None
    crange = head.get("content-range")
    if crange is None:  # a 200: the whole object
        size = got
    else:  # "bytes 0-112639/112640"
        total = crange.rpartition("/")[2]
        if not total.isdigit():
            return None
        size = int(total)
    try:  # as `fileinfo` reads a HEAD's LastModified
        mtime_ns = mtime_ns_of({"mtime": parsedate_to_datetime(head["last-modified"])})
    except (KeyError, TypeError, ValueError):
        mtime_ns = 0
    return etag, size, mtime_ns


def _read_parts(resp, want: int, piece: int, buffers: BufferPool | None) -> list[bytes]:
    """Up to `want` body bytes in `piece`-byte parts (fewer only where the
    body ends), each received into a buffer of `buffers` if given (and of
    `piece` bytes); Declined if the body holds more than `want`."""
    if resp.length > want:
        raise Declined(f"the answer holds {resp.length} bytes, more than the {want} asked "
                       f"for", True)
    if buffers is None or buffers.size != piece:
        return read_parts(lambda n, _pos: resp.read(n), 0, want, piece)
    parts = []
    left = min(want, resp.length)
    while left > 0:
        part = buffers.fill(min(piece, left), resp.readinto)
        parts.append(part)
        left -= len(part)
        if len(part) < piece:
            break
    return parts

