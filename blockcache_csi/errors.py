"""A request the plugin refuses: a gRPC status code and a message naming the
cause and the fix (the kubelet shows it in the pod's events)."""

from __future__ import annotations

import grpc


class CsiError(Exception):
    """Answered as `code` with `message`; never carries secret values."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def required(request: object, *fields: str) -> None:
    """INVALID_ARGUMENT naming the first of `fields` that `request` leaves empty."""
    for name in fields:
        if not getattr(request, name):
            raise invalid(f"{name} is missing: it is a required field of the request")
