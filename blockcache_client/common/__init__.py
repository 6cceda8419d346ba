"""Utilities the daemon, the readers and fsclient share, with no I/O policy of
their own: metrics primitives (`metrics`), log setup (`logsetup`) and the
fork counter (`forks`). They import only the contract."""
