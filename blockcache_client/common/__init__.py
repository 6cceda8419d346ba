"""Utilities the daemon, the readers and fsclient share, with no I/O policy of
their own: metrics primitives (`metrics`), log setup (`logsetup`), the fork
counter (`forks`), config value conversions (`convert`), opening cache files
without following symlinks (`safeopen`), TOML config files (`tomlfile`), the
readers' event counters (`counters`), reads that never wait on the cache
disk (`nowait`) and the JSON-per-packet framing of the keepers' sockets
(`jsonpackets`). They import only the contract."""
