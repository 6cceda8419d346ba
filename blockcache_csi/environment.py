"""The environment a volume's keeper and server run with: built, never inherited.

Nothing of the plugin's own environment reaches them but a few harmless
variables (`PASSED`: the path, locale, time zone, where Python finds its
code, the CA bundle); its AWS_* variables, proxies and everything else stay
in the plugin. Then, for the volume:

- its S3 credentials, from the Secret of its nodePublishSecretRef
  (`awsAccessKeyId`, `awsSecretAccessKey`, optional `awsSessionToken`);
- the operator's S3 endpoint and region (`--s3-endpoint`, `--s3-region`):
  never the pod's, since an endpoint the pod chose would be a request from
  the host's network to any address (see docs/csi.md);
- no other credentials: boto's config and credential files are /dev/null,
  fsspec reads no config file, and the instance metadata service (the node's
  role) is off, unless `--allow-node-credentials NAMESPACE` lets that
  namespace's volumes without keys use it. A volume with neither sends
  unsigned (anonymous) requests: public buckets work, others answer 403.

The credentials are kept for a restarted plugin in the state dir (0600 root,
`state.py`), and never appear in a message, a log line or a command line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import invalid

# the plugin's variables a server may see: nothing that names a credential or an address
PASSED = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "PYTHONHOME", "SSL_CERT_FILE",
          "SSL_CERT_DIR")
PASSED_PREFIXES = ("LC_",)
# Secret keys -> the variable botocore (s3fs) reads
SECRET_KEYS = {"awsAccessKeyId": "AWS_ACCESS_KEY_ID",
               "awsSecretAccessKey": "AWS_SECRET_ACCESS_KEY",
               "awsSessionToken": "AWS_SESSION_TOKEN"}
_PRINTABLE = re.compile(r"[\x21-\x7e]{1,8192}")
_REGION = re.compile(r"[a-z0-9][a-z0-9\-]{0,61}[a-z0-9]")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class EnvironmentSettingError(ValueError):
    """An operator setting of the environment that cannot be used."""


@dataclass(frozen=True)
class SourceCredentials:
    """A volume's own S3 credentials (empty: none given)."""

    values: tuple[tuple[str, str], ...] = ()  # (Secret key, value), sorted

    def __bool__(self) -> bool:
        return bool(self.values)

    def __repr__(self) -> str:  # never the values
        return f"SourceCredentials({', '.join(k for k, _ in self.values) or 'none'})"

    def variables(self) -> dict[str, str]:
        return {SECRET_KEYS[k]: v for k, v in self.values}

    def to_json(self) -> bytes:
        return json.dumps(dict(self.values)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SourceCredentials:
        found = json.loads(data)
        if not isinstance(found, dict) or not set(found) <= set(SECRET_KEYS):
            raise ValueError("not a credentials file")
        return cls(tuple(sorted((str(k), str(v)) for k, v in found.items())))


def parse_credentials(secrets: Mapping[str, str], protocol: str) -> SourceCredentials:
    """The S3 credentials in a publish's `secrets`; errors name keys, never values."""
    given = {k: v.strip() for k, v in secrets.items() if k in SECRET_KEYS}
    if not given:
        return SourceCredentials()
    if protocol != "s3":
        raise invalid(f"secrets {', '.join(sorted(given))} are S3 credentials, but the "
                      f"volume's source is not s3://; remove them from the Secret")
    for pair in (("awsAccessKeyId", "awsSecretAccessKey"), ("awsSecretAccessKey",
                                                            "awsAccessKeyId")):
        if pair[0] in given and pair[1] not in given:
            raise invalid(f'secrets["{pair[0]}"] is given without secrets["{pair[1]}"]; the '
                          f"Secret of nodePublishSecretRef must hold both (and "
                          f"awsSessionToken for temporary credentials)")
    if "awsSessionToken" in given and "awsAccessKeyId" not in given:
        raise invalid('secrets["awsSessionToken"] is given without secrets["awsAccessKeyId"] '
                      'and secrets["awsSecretAccessKey"]')
    for name, value in given.items():
        if not _PRINTABLE.fullmatch(value):
            raise invalid(f'secrets["{name}"] is empty, too long or holds spaces or '
                          f'non-ASCII characters ({len(value)} characters); put the value '
                          f'alone in the Secret')
    return SourceCredentials(tuple(sorted(given.items())))


class ServerEnvironment:
    """The operator's settings of every server's environment."""

    def __init__(self, s3_endpoint: str | None = None, s3_region: str | None = None,
                 node_credentials: tuple[str, ...] = ()):
        if s3_endpoint is not None and not re.fullmatch(r"https?://[^\s/?#@]+/?", s3_endpoint):
            raise EnvironmentSettingError(f"--s3-endpoint {s3_endpoint!r} is not an http(s)://HOST"
                                    f"[:PORT] URL")
        if s3_region is not None and not _REGION.fullmatch(s3_region):
            raise EnvironmentSettingError(f"--s3-region {s3_region!r} is not a region name "
                                    f"(e.g. us-east-1)")
        for ns in node_credentials:
            if not _NAMESPACE.fullmatch(ns):
                raise EnvironmentSettingError(f"--allow-node-credentials {ns!r} is not a namespace "
                                        f"name (a DNS label: a-z 0-9 -)")
        self.s3_endpoint, self.s3_region = s3_endpoint, s3_region
        self.node_credentials = frozenset(node_credentials)

    def build(self, namespace: str, credentials: SourceCredentials,
              inherited: Mapping[str, str] = os.environ) -> dict[str, str]:
        """The whole environment of a keeper (and so of its server) of a volume."""
        env = {k: v for k, v in inherited.items()
               if k in PASSED or k.startswith(PASSED_PREFIXES)}
        env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
                   FSSPEC_CONFIG_DIR=os.devnull)
        node_role = not credentials and namespace in self.node_credentials
        if not node_role:
            env["AWS_EC2_METADATA_DISABLED"] = "true"
        if not credentials and not node_role:
            env["FSSPEC_S3_ANON"] = "true"  # unsigned: no chain to fall back on
        env.update(credentials.variables())
        if self.s3_endpoint:
            env["AWS_ENDPOINT_URL_S3"] = self.s3_endpoint
        if self.s3_region:
            env["AWS_DEFAULT_REGION"] = self.s3_region
        return env
