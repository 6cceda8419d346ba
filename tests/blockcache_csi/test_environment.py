"""The environment a volume's keeper and server get (`environment.py`): only
harmless variables of the plugin's, the volume's own keys, and no way to
the node's role unless the operator allows it for the namespace. (End to
end, with real processes and S3: test_source_credentials.py.)"""

from __future__ import annotations

import os

import pytest

from blockcache_csi.environment import ServerEnvironment, SourceCredentials, parse_credentials
from blockcache_csi.errors import CsiError

PLUGIN = {"PATH": "/usr/bin", "LC_ALL": "C.UTF-8", "PYTHONPATH": "/app", "TZ": "UTC",
          "AWS_ACCESS_KEY_ID": "AKIAPLUGIN", "AWS_SECRET_ACCESS_KEY": "plugin-secret",
          "AWS_ROLE_ARN": "arn:aws:iam::1:role/node", "AWS_WEB_IDENTITY_TOKEN_FILE": "/t",
          "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.2/x",
          "HTTPS_PROXY": "http://proxy:3128", "BLOCKCACHE_CANARY": "1", "HOME": "/root",
          "GOOGLE_APPLICATION_CREDENTIALS": "/sa.json"}
KEYS = SourceCredentials((("awsAccessKeyId", "AKIATENANT"),
                          ("awsSecretAccessKey", "tenant-secret")))


def test_only_harmless_variables_pass_and_no_credential_chain_is_left():
    env = ServerEnvironment("http://127.0.0.1:9000", "eu-west-1").build("team", KEYS, PLUGIN)
    assert env == {"PATH": "/usr/bin", "LC_ALL": "C.UTF-8", "PYTHONPATH": "/app", "TZ": "UTC",
                   "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                   "FSSPEC_CONFIG_DIR": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
                   "AWS_ACCESS_KEY_ID": "AKIATENANT", "AWS_SECRET_ACCESS_KEY": "tenant-secret",
                   "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000",
                   "AWS_DEFAULT_REGION": "eu-west-1"}


def test_a_volume_without_keys_is_anonymous_unless_its_namespace_may_use_the_node_role():
    settings = ServerEnvironment(node_credentials=("trusted",))
    anon = settings.build("team", SourceCredentials(), PLUGIN)
    assert anon["FSSPEC_S3_ANON"] == "true" and anon["AWS_EC2_METADATA_DISABLED"] == "true"
    assert "AWS_ACCESS_KEY_ID" not in anon
    node = settings.build("trusted", SourceCredentials(), PLUGIN)
    assert "FSSPEC_S3_ANON" not in node and "AWS_EC2_METADATA_DISABLED" not in node
    assert "AWS_ACCESS_KEY_ID" not in node and "AWS_ROLE_ARN" not in node
    # keys in the Secret win over the node's role, in any namespace
    assert "AWS_EC2_METADATA_DISABLED" in settings.build("trusted", KEYS, PLUGIN)


@pytest.mark.parametrize("secrets, says", [
    ({"awsAccessKeyId": "AKIAX"}, 'without secrets["awsSecretAccessKey"]'),
    ({"awsSecretAccessKey": "s3cr3t-value"}, 'without secrets["awsAccessKeyId"]'),
    ({"awsSessionToken": "tok3n-value"}, 'secrets["awsSessionToken"] is given without'),
    ({"awsAccessKeyId": "AKIAX", "awsSecretAccessKey": "has space-value"}, "spaces"),
])
def test_bad_credentials_are_refused_by_key_never_by_value(secrets, says):
    with pytest.raises(CsiError) as info:
        parse_credentials(secrets, "s3")
    assert says in info.value.message
    for value in secrets.values():
        assert value not in info.value.message
    assert "value" not in repr(SourceCredentials(tuple(secrets.items())))


def test_keys_for_a_source_that_is_not_s3_are_refused():
    with pytest.raises(CsiError) as info:
        parse_credentials(dict(KEYS.values), "file")
    assert "not s3://" in info.value.message
