"""fsclient: the FUSE client. Mounts one volume read-only through the host's
shared block cache (`blockcached`), one mount per pod.

Modules: `config` (MountConfig from TOML + flags), `metacache` (TTL'd LRU
metadata caches), `fs` (pyfuse3 operations), `mountpoint` (checks, dead-mount
recovery, unmount), `mount` (run, daemonize with readiness), `cli`, `demo`.
"""
