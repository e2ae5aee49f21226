"""The address forms a config may name, checked when the config parses: an HTTP base URL
(servers, a teacher, a reward endpoint), a ZMQ endpoint (transport.address / bind) and a
host:port rendezvous (weight_sync.address).

Why at parse time: a malformed address fails late and obscurely otherwise (the orchestrator
waited forever for a server "not a url" to come up). These checks need no network: whether
something answers there is the programs' business, with timeouts of their own.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{what}: port {text!r} is not a number from 1 to 65535")
    return int(text)


def check_http_url(url: str) -> str:
    """An http(s) base URL with a host (and optionally a port and a path prefix)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port out of range or not a number
    except ValueError as e:
        raise ValueError(f"not a URL ({e}); expected http://host:port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or " " in url:
        raise ValueError("not a URL; expected http://host:port or https://host:port")
    if port == 0:
        raise ValueError("port 0 is not a port; expected http://host:port")
    return url


def check_zmq_endpoint(address: str) -> str:
    """tcp://host:port (host may be * for every interface when binding) or ipc:///path."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme == "ipc" and rest:
        return address
    if not sep or scheme != "tcp":
        raise ValueError("not a ZMQ endpoint; expected tcp://host:port or ipc:///path")
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ValueError("no host:port after tcp://; expected tcp://host:port")
    _port(port, "tcp endpoint")
    return address


def check_host_port(address: str) -> str:
    """host:port ([v6]:port for IPv6)."""
    host, colon, port = address.rpartition(":")
    if not colon or not host.strip("[]"):
        raise ValueError("expected host:port")
    _port(port, "address")
    return address


HttpUrl = Annotated[str, AfterValidator(check_http_url)]
ZmqEndpoint = Annotated[str, AfterValidator(check_zmq_endpoint)]
HostPort = Annotated[str, AfterValidator(check_host_port)]
