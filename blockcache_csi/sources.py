"""Which sources a pod may mount: the operator's allowlist (`--allow-source`).

A volume's `source` comes from the pod author, and its server opens it on the
host's network with the host's files in reach. So every source is first put
in one canonical form, and only that form is matched and mounted:

    a local path, file://P, local://P, file:P   ->  file   /real/path
    s3://B/K, s3a://B/K                          ->  s3     B/K
    http://H[:PORT]/P, https://...               ->  http(s) h[:port]/P

Anything else is refused: a chained URL (`a::b`, e.g. `simplecache::`,
`reference::`, `zip::`), the protocols that serve what the URL itself says
(`data:`, `memory://`, `reference://`) and every protocol not in the table
above. fsspec knows many aliases (`s3a`, `gcs`, `local`...) and chains any of
them; a table of what is served, and nothing else, cannot be slipped past by
one it did not list. A local path is normalized (`..`) and its symlinks
resolved before the prefix check, and the mount opens the resolved path.

A rule is `[NAMESPACE=]PREFIX`: PREFIX in the same canonical form, matched by
whole path components (`s3://data/a` covers `s3://data/a/b`, not
`s3://data/ab`); `s3://` alone covers every bucket, `/` every local path.
A rule with NAMESPACE applies to pods of that namespace (the kubelet's
`csi.storage.k8s.io/pod.namespace`) only. No rule: nothing is allowed.

A refusal by policy is PERMISSION_DENIED (the URL is well formed; the
operator's setting forbids it), naming the rule and the setting; a malformed
URL is INVALID_ARGUMENT.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass

import grpc

from .errors import CsiError, invalid

FIELD = 'volume_context["source"]'
# scheme as the pod may write it -> the protocol served
SCHEMES = {"file": "file", "local": "file", "s3": "s3", "s3a": "s3", "http": "http",
           "https": "https"}
# fsspec protocols whose bytes are what the URL (or a file it names) says: never a source
NEVER = frozenset({"data", "memory", "reference", "simplecache", "filecache", "blockcache",
                   "cached", "dir", "generic", "zip", "tar", "libarchive", "async_wrapper",
                   "asyncwrapper", "blockcached", "latency"})
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(?=:|$)")  # a protocol in a chain
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
RULE_FLAG = "--allow-source"


class SourceRuleError(ValueError):
    """An --allow-source rule that cannot be used; the message names it and the fix."""


def denied(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.PERMISSION_DENIED, message)


@dataclass(frozen=True)
class Canonical:
    """A source in the one form that is matched and mounted."""

    protocol: str  # file, s3, http, https
    location: str  # /real/path, bucket/key, host[:port]/path ("" only in a rule)

    @property
    def url(self) -> str:
        return self.location if self.protocol == "file" else f"{self.protocol}://{self.location}"

    def covers(self, other: Canonical) -> bool:
        """Whether this rule prefix covers `other`, by whole path components."""
        if self.protocol != other.protocol:
            return False
        if not self.location or other.location == self.location:
            return True
        return other.location.startswith(self.location.rstrip("/") + "/")


def canonical(text: str, what: str = FIELD, rule: bool = False) -> Canonical:
    """`text` in canonical form; CsiError naming `what` if it is refused.
    `rule`: an operator's prefix, which may stop at the protocol (`s3://`)."""
    if not text or any(ord(c) < 0x20 or c == "\x7f" for c in text):
        raise invalid(f"{what} {text!r} is empty or holds control characters")
    if "::" in text:
        protocols = [m[0] if (m := _NAME.match(part)) else "file" for part in text.split("::")]
        raise denied(f"{what} {text!r} chains filesystems ({'::'.join(protocols)}); a chained "
                     f"URL is never opened for a pod (its outer layers read what the URL "
                     f"names, e.g. local cache files or a reference map), and no setting "
                     f"allows one: give one s3://, http(s):// URL or local path that an "
                     f"{RULE_FLAG} rule allows")
    if text.startswith("/"):
        return _local(text, what)
    m = _SCHEME.match(text)
    if m is None:
        raise invalid(f"{what} {text!r} is neither an absolute path nor a URL; write "
                      f"s3://bucket/prefix, https://host/path or /abs/path")
    scheme, rest = m[1].lower(), text[m.end():]
    protocol = SCHEMES.get(scheme)
    if protocol is None:
        why = ("it serves bytes the URL itself or a file it names chooses"
               if scheme in NEVER else "the plugin serves only local paths, s3:// and "
                                       "http(s):// sources")
        raise denied(f"{what} {text!r}: protocol {scheme!r} is never a volume's source "
                     f"({why}); no setting allows it")
    if protocol == "file":
        path = rest[2:] if rest.startswith("//") else rest
        return _local(path, what)
    if not rest.startswith("//"):
        raise invalid(f"{what} {text!r}: write {scheme}://...")
    if protocol == "s3":
        return _s3(rest[2:], text, what, rule)
    return _http(protocol, text, what)


def _local(path: str, what: str) -> Canonical:
    if not path.startswith("/") or path.startswith("//"):
        raise invalid(f"{what} {path!r} must be an absolute local path, e.g. /data/set")
    if "://" in path:
        raise invalid(f"{what} {path!r}: a local path holds no '://'")
    # the mount opens what was checked: no '..', no symlink out of the prefix
    real = os.path.realpath(os.path.normpath(path))
    return Canonical("file", real)


def _segments_ok(path: str) -> bool:
    return all(s not in ("", ".", "..") for s in path.split("/"))


def _s3(rest: str, text: str, what: str, rule: bool) -> Canonical:
    location = rest.rstrip("/")
    if rule and not location:
        return Canonical("s3", "")
    bucket = location.split("/", 1)[0]
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise invalid(f"{what} {text!r}: {bucket!r} is not an S3 bucket name (3 to 63 of "
                      f"a-z 0-9 . -); write s3://bucket/prefix")
    if any(c in location for c in "?#\\") or not _segments_ok(location):
        raise invalid(f"{what} {text!r}: an S3 prefix has no '?', '#', '\\', empty, '.' or "
                      f"'..' parts; write s3://bucket/prefix")
    return Canonical("s3", location)


def _http(protocol: str, text: str, what: str) -> Canonical:
    try:
        url = urllib.parse.urlsplit(text)
        port = url.port
    except ValueError as exc:
        raise invalid(f"{what} {text!r} is not a URL: {exc}") from None
    if url.username is not None or url.password is not None or url.query or url.fragment \
            or "#" in text or "?" in text or not url.hostname:
        raise invalid(f"{what} {text!r}: write {protocol}://host[:port]/path, with no user, "
                      f"query or fragment")
    host = url.hostname.lower() + (f":{port}" if port is not None else "")
    path = url.path.rstrip("/")
    # as the web server will read it: %2e%2e is '..' there
    if path and not _segments_ok(urllib.parse.unquote(path)[1:]):
        raise invalid(f"{what} {text!r}: the path has empty, '.' or '..' parts (also "
                      f"percent-encoded)")
    return Canonical(protocol, host + path)


@dataclass(frozen=True)
class SourceRule:
    namespace: str | None  # None: every namespace
    prefix: Canonical

    def __str__(self) -> str:
        return (f"{self.namespace}=" if self.namespace else "") + self.prefix.url


def parse_rule(entry: str) -> SourceRule:
    """`[NAMESPACE=]PREFIX` -> SourceRule; a URL or path never has '=' before its ':' or '/'."""
    namespace: str | None = None
    head, eq, tail = entry.partition("=")
    if eq and "/" not in head and ":" not in head:
        if not _NAMESPACE.fullmatch(head):
            raise SourceRuleError(f"{RULE_FLAG} {entry!r}: {head!r} is not a namespace name "
                                  f"(a DNS label: a-z 0-9 -)")
        namespace, entry = head, tail
    try:
        prefix = canonical(entry, f"{RULE_FLAG} prefix", rule=True)
    except CsiError as exc:
        raise SourceRuleError(exc.message) from None
    return SourceRule(namespace, prefix)


class SourcePolicy:
    """The operator's rules: which sources the pods of a namespace may mount."""

    def __init__(self, rules: list[SourceRule]):
        self.rules = list(rules)

    @classmethod
    def from_entries(cls, entries: tuple[str, ...]) -> SourcePolicy:
        return cls([parse_rule(e) for e in entries])

    def applying(self, namespace: str) -> list[SourceRule]:
        return [r for r in self.rules if r.namespace in (None, namespace)]

    def check(self, source: str, namespace: str) -> str:
        """The canonical URL of `source` if a rule allows it for `namespace`."""
        found = canonical(source)
        rules = self.applying(namespace)
        if any(r.prefix.covers(found) for r in rules):
            return found.url
        listed = ", ".join(str(r) for r in rules) or "none"
        raise denied(f"{FIELD} {source!r} (read as {found.url}) is not allowed in namespace "
                     f"{namespace!r}: no {RULE_FLAG} rule covers it (the rules for this "
                     f"namespace: {listed}). The plugin's operator may allow it with "
                     f"{RULE_FLAG} {namespace}={found.url} (or without '{namespace}=' for "
                     f"every namespace)")
