"""The error hierarchy shared by the client library and the daemon.

Every message names the thing that is wrong and, where there is one, the fix.
The CLI turns these into one line and a non-zero exit code.
"""


class BlockcacheError(Exception):
    """Base of every error this project raises on purpose."""


class InvalidKey(BlockcacheError, ValueError):
    """A block key string is not in canonical `vol_inode_extent_offset` form."""


class FormatError(BlockcacheError, ValueError):
    """A block file's header or length is not a valid block file."""


class IntegrityError(BlockcacheError):
    """A block failed authentication: tampered, truncated, renamed or wrong key."""


class ConfigError(BlockcacheError, ValueError):
    """A configuration value, flag or file is invalid."""


class ProtocolError(BlockcacheError):
    """A frame or request violates the wire protocol.

    `code` is one of `protocol.ErrorCode`; the daemon sends it back as is.
    """

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class DaemonError(BlockcacheError):
    """The daemon answered a request with an error reply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message


class DaemonUnavailable(BlockcacheError):
    """The daemon cannot be reached: socket missing, refused, closed or timed out."""


class UntrustedPeer(DaemonUnavailable):
    """The process answering on the socket runs as a uid the daemon must not
    have (`peercheck.check_peer`): treated as no daemon, but worth a warning."""
