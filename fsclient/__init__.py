"""fsclient: the FUSE client. Mounts one volume read-only through the host's
shared block cache (`blockcached`), one mount per pod.

Modules: `session/` (the kernel's FUSE protocol: mounting, INIT, worker
threads), `fs` (the handlers), `config` (MountConfig from TOML + flags),
`metacache` (TTL'd LRU metadata caches), `mountpoint` (checks, dead-mount
recovery, unmount), `mount` (run, daemonize with readiness), `cli`, `warmup/`.
"""
