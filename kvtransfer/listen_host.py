"""Keep the UCX listener to one host address, as a bound socket would be.

ucxx 0.52 listens on every interface (its listener takes a port, never an
address), so a worker started with `--host 127.0.0.1` would still take KV
connections arriving on its public addresses.  The next best thing to binding
is refusing: every incoming connection's local address (the address the peer
dialled) is read from UCX (`ucp_ep_query`), and a connection that did not
arrive on the listen host is closed before a message is read from it.

`ucp_ep_query` is not wrapped by ucxx; it is called through ctypes against the
libucp that ucxx itself loaded.  The offsets below are those of `ucp_ep_attr_t`
in UCX 1.x (field mask, a 32-byte name, then the local and the remote
`sockaddr_storage`); anything that does not read as an IPv4 or IPv6 address is
treated as unknown, and an unknown address is refused (closed, not open).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
from functools import cache

log = logging.getLogger(__name__)

_LOCAL_SOCKADDR = 1 << 1  # UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR
_REMOTE_SOCKADDR = 1 << 2  # UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR
_NAME_BYTES = 32  # UCP_ENTITY_NAME_MAX
_SOCKADDR_STORAGE = 128
_LOCAL_AT = 8 + _NAME_BYTES
_REMOTE_AT = _LOCAL_AT + _SOCKADDR_STORAGE
_ATTR_BYTES = 4096  # room for fields a later UCX appends; only the mask's fields are written

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@cache
def _libucp() -> ctypes.CDLL | None:
    try:
        import libucx  # the wheel ucxx loads its UCX from

        lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
    except (ImportError, OSError):
        try:
            lib = ctypes.CDLL("libucp.so")
        except OSError:
            return None
    lib.ucp_ep_query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ucp_ep_query.restype = ctypes.c_int
    return lib


def _sockaddr(raw: bytes, at: int) -> Address | None:
    family = struct.unpack_from("=H", raw, at)[0]
    if family == socket.AF_INET:
        return ipaddress.IPv4Address(raw[at + 4:at + 8])
    if family == socket.AF_INET6:
        addr = ipaddress.IPv6Address(raw[at + 8:at + 24])
        return addr.ipv4_mapped or addr
    return None


def endpoint_addresses(ucp_endpoint: int) -> tuple[Address | None, Address | None]:
    """(local, remote) address of a connected UCX endpoint (a `ucp_ep_h` as an int);
    None for what UCX could not tell."""
    lib = _libucp()
    if lib is None or not ucp_endpoint:
        return None, None
    attr = ctypes.create_string_buffer(_ATTR_BYTES)
    struct.pack_into("=Q", attr, 0, _LOCAL_SOCKADDR | _REMOTE_SOCKADDR)
    if lib.ucp_ep_query(ctypes.c_void_p(ucp_endpoint), attr) != 0:  # UCS_OK
        return None, None
    raw = attr.raw
    return _sockaddr(raw, _LOCAL_AT), _sockaddr(raw, _REMOTE_AT)


class ListenHost:
    """Which local addresses a connection may arrive on: the listen host's
    (every address it resolves to), or any for a wildcard (0.0.0.0, ::, '')."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.any = host in ("", "0.0.0.0", "::", "*")
        self.addresses: frozenset[Address] = frozenset() if self.any else _resolve(host)

    def admits(self, local: Address | None) -> bool:
        return self.any or (local is not None and local in self.addresses)


def _resolve(host: str) -> frozenset[Address]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"listen host {host!r} does not resolve: {e}") from e
    out: set[Address] = set()
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        out.add(addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped
                else addr)
    return frozenset(out)
