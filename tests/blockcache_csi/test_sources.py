"""How the source policy reads a source (`blockcache_csi/sources.py`): every
alias to one canonical form, rules matched by whole path components, and
the refusals of what no rule can allow. (Through the plugin, with real
mounts: test_source_policy.py.)"""

from __future__ import annotations

import os

import grpc
import pytest

from blockcache_csi.errors import CsiError
from blockcache_csi.sources import SourcePolicy, SourceRuleError, canonical, parse_rule


@pytest.mark.parametrize("written, read", [
    ("/data/a/", "/data/a"),
    ("file:///data/a", "/data/a"),
    ("FILE:/data/a", "/data/a"),
    ("local:///data/./b/../a", "/data/a"),
    ("s3a://bucket/key/", "s3://bucket/key"),
    ("S3://bucket", "s3://bucket"),
    ("HTTPS://Example.COM:8443/d/", "https://example.com:8443/d"),
])
def test_every_alias_reads_as_one_canonical_form(written, read):
    assert canonical(written).url == read


def test_a_local_path_is_read_through_its_symlinks(tmp_path):
    (tmp_path / "allowed").mkdir()
    os.symlink("/etc", tmp_path / "allowed" / "out")
    assert canonical(str(tmp_path / "allowed" / "out")).url == "/etc"


@pytest.mark.parametrize("source, code, says", [
    ("reference::s3://b/refs.json", "PERMISSION_DENIED", "reference::s3"),
    ("zip://a.csv::/data/x.zip", "PERMISSION_DENIED", "zip::file"),
    ("blockcache::s3://bucket/x", "PERMISSION_DENIED", "blockcache::s3"),
    ("data:text/plain,hello", "PERMISSION_DENIED", "protocol 'data'"),
    ("memory://x", "PERMISSION_DENIED", "protocol 'memory'"),
    ("gcs://bucket/x", "PERMISSION_DENIED", "protocol 'gcs'"),
    ("ftp://host/x", "PERMISSION_DENIED", "protocol 'ftp'"),
    ("relative/path", "INVALID_ARGUMENT", "neither an absolute path nor a URL"),
    ("s3://bucket/a/../b", "INVALID_ARGUMENT", "'..'"),
    ("s3://Bad_Bucket/x", "INVALID_ARGUMENT", "not an S3 bucket name"),
    ("s3://bucket/x?versionId=1", "INVALID_ARGUMENT", "'?'"),
    ("https://host/d/%2e%2e/secret", "INVALID_ARGUMENT", "percent-encoded"),
    ("https://user:pw@host/d", "INVALID_ARGUMENT", "no user"),
    ("/data\n/x", "INVALID_ARGUMENT", "control characters"),
])
def test_what_no_rule_can_allow_is_refused_by_name(source, code, says):
    with pytest.raises(CsiError) as info:
        SourcePolicy.from_entries(("s3://", "/", "https://host")).check(source, "ns")
    assert info.value.code == getattr(grpc.StatusCode, code)
    assert says in info.value.message, info.value.message


def test_rules_match_whole_components_per_namespace():
    policy = SourcePolicy.from_entries(("s3://data/a", "team=https://host/d", "other=/srv"))
    assert policy.check("s3://data/a/b", "x") == "s3://data/a/b"
    assert policy.check("s3a://data/a", "x") == "s3://data/a"
    assert policy.check("https://HOST/d/e", "team") == "https://host/d/e"
    for source, namespace in (("s3://data/ab", "x"), ("s3://data", "x"),
                              ("https://host/d/e", "x"), ("https://host.evil/d", "team"),
                              ("/srv/x", "team")):
        with pytest.raises(CsiError) as info:
            policy.check(source, namespace)
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert f"--allow-source {namespace}=" in info.value.message
        assert "other=" not in info.value.message  # another namespace's rules stay unshown


def test_a_rule_is_namespace_then_prefix():
    assert str(parse_rule("team-a=s3://bkt/x=y")) == "team-a=s3://bkt/x=y"
    assert parse_rule("s3://bkt/x=y").namespace is None  # '=' after the ':' is the URL's
    assert parse_rule("/data/k=v").prefix.url == "/data/k=v"
    assert parse_rule("s3://").prefix.covers(canonical("s3://any-bucket/x"))
    with pytest.raises(SourceRuleError, match="not a namespace name"):
        parse_rule("Team=s3://bkt")
