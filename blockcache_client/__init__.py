"""blockcache client library: the contract (keys, block file format, wire
protocol, on-disk layout) and everything a reader needs on top of it.

The daemon (`blockcached`) imports only the contract modules: `keys`,
`blockfile`, `protocol`, `wire`, `layout`, `units`, `errors`.
"""
