"""`sigv4` signs an S3 GET exactly as botocore's S3SigV4Auth does (same headers, same
signature) at any time, for any key, region and token."""

from __future__ import annotations

import datetime

import botocore.auth
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

from blockcache_client.sources.sigv4 import SigV4

CASES = [
    ("http://127.0.0.1:9000/bucket/a/b%20c.bin", {"Range": "bytes=0-99"}, "us-east-1", None),
    ("https://bucket.s3.eu-west-1.amazonaws.com/k/%7Ex", {"Range": "bytes=5-",
     "If-Match": '"abc"', "User-Agent": "blockcache-s3direct"}, "eu-west-1", "tok/en=="),
    ("https://s3.example.com:443/b/key", {"Range": "bytes=1-2  "}, "auto", None),
]


@pytest.mark.parametrize("url,headers,region,token", CASES)
@pytest.mark.parametrize("when", [1_800_000_000, 1_700_000_123])
def test_signature_equals_botocores(monkeypatch, url, headers, region, token, when):
    now = datetime.datetime.fromtimestamp(when, datetime.UTC).replace(tzinfo=None)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now)
    request = AWSRequest(method="GET", url=url, headers=dict(headers))
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret/key+1", token), "s3", region).add_auth(request)
    want = dict(request.headers.items())
    signer = SigV4()
    for _ in range(2):  # the day's key derived, then kept
        got = signer.sign(url, headers, region, "AKIDEXAMPLE", "secret/key+1", token, when)
        assert got == want


@pytest.mark.parametrize("query", [{}, {"partNumber": "7", "uploadId": "a/b+c=="}])
def test_an_unsigned_payload_put_equals_botocores(monkeypatch, query):
    when = 1_800_000_000
    now = datetime.datetime.fromtimestamp(when, datetime.UTC).replace(tzinfo=None)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now)
    from urllib.parse import quote
    canonical = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                         for k, v in sorted(query.items()))
    url = "https://s3.example.com/bucket/ckpt/model%20a.pt"
    headers = {"Content-Length": "11", "x-amz-checksum-crc32": "AAAAAA=="}
    request = AWSRequest(method="PUT", url=url + (f"?{canonical}" if canonical else ""),
                         headers=dict(headers), data=b"hello world")
    # UNSIGNED-PAYLOAD: what botocore sends with payload signing off
    request.context["client_config"] = Config(s3={"payload_signing_enabled": False})
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret", None), "s3", "eu-west-1").add_auth(request)
    want = dict(request.headers.items())
    got = SigV4().sign_path("s3.example.com", "/bucket/ckpt/model%20a.pt", headers, "eu-west-1",
                            "AKIDEXAMPLE", "secret", None, when, method="PUT", query=canonical,
                            payload="UNSIGNED-PAYLOAD")
    assert got == want
