"""The writer: files written into a volume, staged on the node, uploaded whole on close.

Modules, each importing only those above it in this list's reverse:
- `staging`: the staging directory and its bound per volume (ENOSPC past it);
- `stagedfile`: one file's bytes staged, sealed at rest as cached blocks are;
- `upload`: a staged file to the remote as one object (one PUT, or parts in
  parallel), through `sources.remotewrites`; `streaming`: its parts sent
  while it is written;
- `stamps`: this host's other mounts of the volume told of each change;
- `written`: what was uploaded put in the host's cache under its new version,
  and a renamed file's cached blocks put under its new name;
- `writes`: the `Writes` of a volume (open, commit, release; mkdir, rmdir,
  unlink, rename) and its `WriteHandle`;
- `writefile`: the file object of `Volume.open(path, "wb")`.

The room sits under the reader (`Volume` builds a `Writes` per process) and
over `daemonclient` and `sources`; fsclient uses it through `Volume`.
"""
