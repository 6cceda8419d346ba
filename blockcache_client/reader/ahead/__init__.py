"""Ahead: what is fetched before a read asks for it.

`sequential`: when a run of reads is sequential, and how many blocks its
miss brings (a window; the next one in the background); `prefetch`: the
background fetches, cancelled with their run; `hostfill`: files put into the
host cache for readers in other processes (`prefetchahead`).
"""
