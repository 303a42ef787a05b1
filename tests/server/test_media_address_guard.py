"""The image fetcher's address guard sits in the connection: a host is resolved once and the socket
connects to the address that was checked, so a name that answers differently the second time (DNS
rebinding) never reaches a private address. A fake resolver stands in for DNS; the servers and
sockets are real."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import anyio._core._sockets
import pytest
from corectl.server.http.errors import APIError
from corectl.server.http.media import address_guard
from corectl.server.http.media.address_guard import guarded_client
from corectl.server.http.media.fetch import fetch_image
from corectl.server.http.media.settings import MediaSettings

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64


class _Image(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.hosts.append(self.headers["Host"])
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Image)
    httpd.hosts = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def resolver(monkeypatch):
    """Answers each lookup of a name with the next address of its list (the last one repeats).
    Connecting to an IP address makes no lookup (anyio), so every lookup is of a name."""
    answers: dict[str, list[str]] = {}
    lookups: list[str] = []

    async def getaddrinfo(host, port, *, type=0, **kwargs):  # noqa: A002 (anyio's name)
        lookups.append(host)
        queue = answers[host]
        address = queue.pop(0) if len(queue) > 1 else queue[0]
        return [(2, type, 6, "", (address, port))]

    # Both the guard's lookup and any lookup a connection by name would make (anyio's own).
    monkeypatch.setattr(address_guard.anyio, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(anyio._core._sockets, "getaddrinfo", getaddrinfo)
    return answers, lookups


def _fetch(url: str, **settings) -> bytes:
    media = MediaSettings(**{"allow_any_domain": True, "fetch_timeout": 5.0, **settings})

    async def run():
        async with guarded_client(media) as client:
            return await fetch_image(client, url, media)
    return anyio.run(run)


def test_the_connection_goes_to_the_checked_address_under_the_urls_host_name(image_server, resolver):
    answers, lookups = resolver
    answers["images.example"] = ["127.0.0.1"]
    assert _fetch(f"http://images.example:{image_server.server_port}/cat.png", allow_private=True) == PNG
    assert lookups == ["images.example"]
    assert image_server.hosts == [f"images.example:{image_server.server_port}"]


def test_a_name_that_rebinds_to_a_private_address_never_reaches_it(image_server, resolver):
    answers, lookups = resolver
    # A public address to the first lookup, loopback to any later one: a check followed by a second
    # lookup at connect time would fetch from the loopback server. (Documentation ranges such as
    # 198.51.100.0/24 are not global, so a routable address stands for "public".)
    answers["rebind.example"] = ["93.184.215.14", "127.0.0.1"]
    with pytest.raises(APIError) as caught:
        _fetch(f"http://rebind.example:{image_server.server_port}/cat.png", fetch_timeout=1.0)
    assert caught.value.code in ("media_fetch_failed", "media_fetch_timeout")
    assert lookups == ["rebind.example"]
    assert image_server.hosts == []


def test_a_private_answer_is_refused_at_connect_time(image_server, resolver):
    answers, _ = resolver
    answers["inside.example"] = ["10.1.2.3", "127.0.0.1"]
    with pytest.raises(APIError, match="may not reach 10.1.2.3") as caught:
        _fetch(f"http://inside.example:{image_server.server_port}/cat.png")
    assert caught.value.code == "media_address_not_allowed"
    assert image_server.hosts == []
