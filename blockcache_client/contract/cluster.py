"""The cluster tier's settings, as the daemon holds them and hands them to
readers in `hello` (key `cluster`, absent when no pool is configured).

Membership is configured once, in the daemon (`--memcached`, `[cluster]`);
readers then talk to the memcached servers themselves. An entry is
`HOST:PORT` (`[V6]:PORT` for an IPv6 literal); a HOST that is a DNS name is
resolved by each reader to all its addresses, again every `dns_refresh`
seconds (a Kubernetes headless Service). The TLS files are paths that
readers open themselves: mount them at the same place in reader pods.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import ConfigError
from .units import parse_duration, parse_size

# [cluster] key -> converter; the wire form holds the converted values
_DURATIONS = ("connect_timeout", "timeout", "retry_after", "dns_refresh")
_FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file")
KEYS = ("memcached", *_DURATIONS, "fill_queue_bytes", *_FILES)


def parse_server(entry: Any, what: str = "memcached") -> tuple[str, int]:
    """(host, port) of one `HOST:PORT` entry; ConfigError naming it otherwise."""
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(f"{what}: {entry!r} is not HOST:PORT")
    text = entry.strip()
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: {entry!r} is not HOST:PORT (a port in 1..65535); "
                          f"for example 10.0.0.5:11211 or memcached.blockcache:11211")
    if ":" in host and not (bracketed and is_ip(host)):  # where would the port start?
        raise ConfigError(f"{what}: {entry!r}: write an IPv6 address in brackets, "
                          f"like [fd00::5]:11211")
    if any(c.isspace() for c in host):
        raise ConfigError(f"{what}: {entry!r}: the host name holds a space")
    return host, int(port)


def is_ip(host: str) -> bool:
    """An IP literal (used as it is), not a DNS name (resolved periodically)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ClusterConfig:
    memcached: tuple[str, ...]
    connect_timeout: float = 0.02
    timeout: float = 0.05
    retry_after: float = 5.0
    dns_refresh: float = 30.0
    fill_queue_bytes: int = 64 << 20
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    @classmethod
    def parse(cls, table: dict[str, Any], what: str = "[cluster]") -> ClusterConfig | None:
        """From a `[cluster]` TOML table (or flags in the same shape); None
        when it names no server. ConfigError for an unknown key or bad value."""
        unknown = set(table) - set(KEYS)
        if unknown:
            raise ConfigError(f"{what}: unknown key(s) {', '.join(sorted(unknown))}; "
                              f"allowed: {', '.join(KEYS)}")
        where = what if what.startswith("--") else f"{what} memcached"
        servers = table.get("memcached", [])
        if isinstance(servers, str):  # `--memcached a:1,b:2`
            servers = [s for s in servers.split(",") if s.strip()]
        if not isinstance(servers, (list, tuple)):
            raise ConfigError(f"{where}: a list of \"HOST:PORT\" strings")
        for s in servers:
            parse_server(s, where)
        if not servers:
            return None
        values: dict[str, Any] = {"memcached": tuple(s.strip() for s in servers)}
        for k in _DURATIONS:
            if k in table:
                values[k] = parse_duration(table[k], f"{what} {k}")
                if not values[k] > 0:
                    raise ConfigError(f"{what} {k}: must be more than zero, like 50ms")
        if "fill_queue_bytes" in table:
            values["fill_queue_bytes"] = parse_size(table["fill_queue_bytes"],
                                                    f"{what} fill_queue_bytes")
        for k in _FILES:
            v = table.get(k)
            if v not in (None, ""):
                if not isinstance(v, str):
                    raise ConfigError(f"{what} {k}: must be a path")
                values[k] = v
        if bool(values.get("tls_cert_file")) != bool(values.get("tls_key_file")):
            raise ConfigError(f"{what}: tls_cert_file and tls_key_file go together "
                              f"(a client certificate needs its key)")
        return cls(**values)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file or self.tls_cert_file)

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["memcached"] = list(self.memcached)
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_wire(cls, data: Any) -> ClusterConfig | None:
        """What `hello` carries; None (no tier) for nothing or a malformed value."""
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(cls)}
        try:
            return cls.parse({k: v for k, v in data.items() if k in known}, "hello cluster")
        except ConfigError:
            return None
