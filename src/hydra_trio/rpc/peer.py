"""What the peer of an RPC connection did before its reply: reset, sent its FIN, or nothing.

A client that closes sends a FIN, and so does one that only shut down its write side
(``shutdown(SHUT_WR)``) and still reads: TCP cannot tell the two apart passively, both read
as EOF. The difference shows only once data reaches the peer: a closed socket answers it
with a reset (RST), a half-closed one acknowledges it. Which ops stop for what (``HangUp``):

- PREFILL (``HangUp.EOF``): EOF or a reset while it runs cancels it at once, within the chunk
  it is in. Its reply comes only after the whole prompt is computed, seconds on a long one,
  and a client that cancels closes its socket (the coordinator does): a FIN is the hang-up
  it sends. The price: a client that half-closes before its PREFILL reply gets none.
- DECODE (``HangUp.RESET``): a reset cancels it at once; EOF alone cancels nothing. Its reply
  comes at once (validation and the restore, bounded by --decode-validate-timeout-s), so
  running to it costs little, and a half-closed client gets it: once it is written,
  ``reset_after_reply`` waits a few round trips for the peer's answer: a reset means nobody
  read the reply (abandon the decode request it started); an acknowledgement, or silence
  within the bound, means the reply was taken (commit).
- every other op (``HangUp.NEVER``) is short and runs to its reply.

Linux only (POLLRDHUP, TIOCOUTQ, TCP_INFO), like the rest of the RPC server.
"""
from __future__ import annotations

import enum
import fcntl
import select
import socket as stdsocket
import struct
import termios

import trio

# After the reply, wait max(4 RTT, floor) for a reset, never more than the cap: a closed peer
# answers the reply's first segment with a reset within about one round trip.
RESET_WAIT_FLOOR_S = 0.020
RESET_WAIT_CAP_S = 0.200
_POLL_S = 0.001  # while waiting for the reply's answer (a few ms at most on loopback)
_EOF_POLL_S = 0.050  # after EOF, POLLIN stays set: a later reset can only be polled for
_TCPI_RTT = struct.Struct("<I")  # struct tcp_info.tcpi_rtt (microseconds), at offset 68
_TCPI_RTT_OFFSET = 68


class HangUp(enum.Enum):
    """What tells that an op's caller has gone while the op runs (the module's docstring)."""

    NEVER = "never"  # short ops: they run to their reply
    RESET = "reset"  # a reset; EOF may be a half-close (DECODE: its reply comes at once)
    EOF = "eof"  # EOF or a reset (PREFILL: a long op whose client closes to cancel)


def _events(sock: trio.socket.SocketType) -> int:
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return sum(events for _, events in poller.poll(0))


def was_reset(sock: trio.socket.SocketType) -> bool:
    """The connection was reset (or is otherwise dead). Only an error sets POLLERR, and
    POLLHUP needs both directions shut, and this side never shuts its write side first."""
    return bool(_events(sock) & (select.POLLERR | select.POLLHUP))


def saw_eof(sock: trio.socket.SocketType) -> bool:
    """The peer sent its FIN: it closed, or shut down only its write side."""
    return bool(_events(sock) & (select.POLLRDHUP | select.POLLERR | select.POLLHUP))


async def wait_hang_up(sock: trio.socket.SocketType, hang_up: HangUp) -> None:
    """Return when the peer hangs up as ``hang_up`` counts it (never for NEVER). Consumes
    nothing (peeks). Data instead of EOF (a pipelined request, which the protocol does not
    allow) ends the watch."""
    if hang_up is HangUp.NEVER:
        await trio.sleep_forever()
    try:
        data = await sock.recv(1, stdsocket.MSG_PEEK)
    except OSError:
        return
    if data:
        await trio.sleep_forever()
    if hang_up is HangUp.EOF:
        return
    # EOF: a half-close, or a close we cannot see yet. An abortive close (SO_LINGER 0) after
    # the FIN still sends a reset; POLLIN stays set from now on, so poll for it.
    while not was_reset(sock):  # noqa: ASYNC110 (no event to wait on: a reset after EOF is polled)
        await trio.sleep(_EOF_POLL_S)


def _unsent_or_unacked(sock: trio.socket.SocketType) -> int | None:
    """Bytes written to the socket the peer has not acknowledged yet (SIOCOUTQ)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return None
    return int(struct.unpack("<i", raw)[0])


def reset_wait_s(sock: trio.socket.SocketType) -> float:
    """max(4 RTT, floor), capped: how long a closed peer may take to answer with a reset."""
    rtt_s = 0.0
    try:
        raw = sock.getsockopt(stdsocket.IPPROTO_TCP, stdsocket.TCP_INFO, 104)
        if len(raw) >= _TCPI_RTT_OFFSET + 4:
            rtt_s = _TCPI_RTT.unpack_from(raw, _TCPI_RTT_OFFSET)[0] / 1e6
    except (OSError, AttributeError):
        pass
    return min(max(4 * rtt_s, RESET_WAIT_FLOOR_S), RESET_WAIT_CAP_S)


async def reset_after_reply(sock: trio.socket.SocketType) -> bool:
    """Call after writing a reply to a peer that sent EOF: True when the peer answered the
    reply with a reset (it had closed: nobody read the reply), False when it acknowledged
    every byte (it only half-closed) or stayed silent for ``reset_wait_s``."""
    with trio.move_on_after(reset_wait_s(sock)):
        while True:
            if was_reset(sock):
                return True
            if _unsent_or_unacked(sock) == 0:
                # A closed socket answers data with a reset, never an ACK; a reset after
                # this point means the peer took the bytes and dropped them itself.
                return False
            await trio.sleep(_POLL_S)
    return was_reset(sock)
