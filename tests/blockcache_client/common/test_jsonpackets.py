"""The keepers' framing: a JSON object and its descriptors arrive whole; what
is not a JSON object is an error answer with its descriptors closed, and the
other end's leaving is None."""

from __future__ import annotations

import array
import os
import socket

from blockcache_client.common import jsonpackets


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def test_a_message_and_its_descriptors_arrive_whole():
    a, b = _pair()
    r, w = os.pipe()
    with a, b:
        jsonpackets.send(a, {"op": "key"}, [r])
        message, fds = jsonpackets.receive(b, 1 << 16)
        assert message == {"op": "key"} and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"  # the same pipe
        for fd in (r, w, *fds):
            os.close(fd)


def test_what_is_no_json_object_is_an_error_and_its_descriptors_are_closed():
    a, b = _pair()
    with a, b:
        for data in (b"\xff\x00 not json", b"[1, 2]", b'"op"', b"null"):
            r, w = os.pipe()
            a.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
            os.close(r)
            message, fds = jsonpackets.receive(b, 1 << 16)
            assert fds == [] and set(message) == {"error"}, (data, message)
            assert f"{len(data)} bytes" in message["error"]
            # the descriptor that came with it was closed here: the pipe has no reader
            try:
                os.write(w, b"x")
                raise AssertionError(f"a descriptor sent with {data!r} was kept")
            except BrokenPipeError:
                pass
            finally:
                os.close(w)


def test_the_other_end_leaving_is_none():
    a, b = _pair()
    a.close()
    with b:
        assert jsonpackets.receive(b, 1 << 16) == (None, [])
