"""Talking to `blockcached` over its unix socket.

- `client` (`Client`, blocking) and `asyncclient` (`AsyncClient`, asyncio):
  framing and connections; both speak the protocol ops of `ops`, and check
  the daemon's uid with `peercheck`;
- `link` (`DaemonLink`): a volume's background link, its control thread
  (connect, touch, ping), on top of `fillqueue`: the fills readers offer and
  the filler thread that sends them;
- `readerarea` (`ReaderArea`): the reader's side of a fill connection's fill
  area (the agreement is `contract/fillarea.py`; the daemon's side is
  `blockcached/daemonarea.py`).
"""
