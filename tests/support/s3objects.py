"""What an S3 prefix holds, read straight from the server (not through a
volume): an object's bytes, and the multipart uploads left under it."""

from __future__ import annotations

import boto3


def straight(source, rel: str) -> bytes | None:
    """The object `rel` of an `S3Source`, or None if there is none."""
    path = f"{source.base}/{rel}"
    source.fs.invalidate_cache()
    return source.fs.cat(path) if source.fs.exists(path) else None


def uploads_left(s3_server, source) -> list:
    """The multipart uploads under the source's prefix that were neither
    completed nor aborted."""
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    found = client.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=source.prefix)
    return found.get("Uploads", [])
