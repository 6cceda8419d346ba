"""Credentials that a moto S3 server checks: IAM users with access keys, then
authentication switched on (moto accepts anything until it is), so an
unsigned request or an unknown key is answered 403 as S3 would."""

from __future__ import annotations

import json
import urllib.request

from devtools.s3server import S3Server

ALLOW_ALL = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "*", "Resource": "*"}]})


def access_key(server: S3Server, user: str) -> tuple[str, str]:
    """(access key id, secret) of a new IAM user `user` allowed everything;
    call it before `enforce`."""
    import boto3
    iam = boto3.client("iam", endpoint_url=server.endpoint_url, region_name="us-east-1",
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=ALLOW_ALL)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


def enforce(server: S3Server) -> None:
    """From now on every request must be signed by a known key."""
    request = urllib.request.Request(f"{server.endpoint_url}/moto-api/reset-auth", data=b"0",
                                     method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(request, timeout=10).close()
