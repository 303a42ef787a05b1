"""Images through the chat API into a tiny Qwen2.5-VL (a real `corectl serve` and the `openai`
client), every bad input a 400 naming its limit with the server healthy after; and the URL fetcher's
own bounds (a host that never answers, a redirect hop to a host not allowed, the byte limit)."""
from __future__ import annotations

import socket
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import httpx
import pytest
from openai import OpenAI
from support.openai_errors import expect_error
from support.server import API_KEY, ServerProcess
from support.vision_models import data_url, png_bytes, random_image

from corectl.server.http.errors import APIError
from corectl.server.http.media.address_guard import guarded_client
from corectl.server.http.media.fetch import fetch_image
from corectl.server.http.media.settings import MediaSettings


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _huge_png_header(width: int, height: int) -> bytes:
    """A 69-byte PNG whose header claims width x height pixels (its data holds a few)."""
    header = _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")


def _image_message(*urls: str, text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(random_image(100, 70, 1)))
    return folder


@pytest.fixture(scope="module")
def vlm_server(qwen2_5_vl_dir, media_dir):
    proc = ServerProcess(str(qwen2_5_vl_dir), "--api-key", API_KEY, "--dtype", "float32", "--kv-cache-memory", "0.02",
                         "--max-model-len", "256", "--limit-mm-per-prompt", '{"image": 2}',
                         "--allow-any-media-domain", "--max-image-pixels", "1000000",
                         "--allowed-local-media-path", str(media_dir),
                         "--served-model-name", "m").wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def vlm_http(vlm_server):
    with httpx.Client(base_url=vlm_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


def _chat(client: httpx.Client, messages, max_tokens: int = 3) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": max_tokens,
                                                   "temperature": 0})


def test_a_data_url_image_through_the_openai_client_and_tokenize_counts_its_tokens(vlm_server, vlm_http):
    messages = _image_message(data_url(png_bytes(random_image(100, 70, 1))))
    client = OpenAI(base_url=vlm_server.url + "/v1", api_key=API_KEY)
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=3,
                                           temperature=0)
    assert reply.choices[0].message.content is not None
    counted = vlm_http.post("/tokenize", json={"messages": messages}).json()["count"]
    text_only = vlm_http.post("/tokenize", json={"messages": _image_message()}).json()["count"]
    assert reply.usage.prompt_tokens == counted > text_only + 1  # the image's placeholders, not one token


@pytest.mark.parametrize(("url", "code"), [
    (data_url(b"\x89PNG\r\n\x1a\nnot an image at all"), "invalid_image"),
    (data_url(b"hello", "text/plain"), "unsupported_media_type"),
    (data_url(_huge_png_header(10000, 10000)), "image_too_large"),
    ("http://127.0.0.1:9/cat.png", "media_address_not_allowed"),
    ("file:///etc/passwd", "media_path_not_allowed"),
    ("file://otherhost/cat.png", "invalid_image_url"),
])
def test_bad_images_are_400s_naming_the_limit(vlm_http, url, code):
    expect_error(_chat(vlm_http, _image_message(url)), 400, "messages", code)


def test_an_image_part_takes_vllms_bare_url_and_openais_detail_values(vlm_http):
    url = data_url(png_bytes(random_image(60, 60, 3)))
    part = {"type": "text", "text": "What is this?"}
    whole = _chat(vlm_http, [{"role": "user", "content": [part, {"type": "image_url", "image_url": {"url": url}}]}])
    bare = _chat(vlm_http, [{"role": "user", "content": [part, {"type": "image_url", "image_url": url}]}])
    low = _chat(vlm_http, [{"role": "user", "content": [part, {"type": "image_url",
                                                               "image_url": {"url": url, "detail": "low"}}]}])
    assert whole.status_code == bare.status_code == low.status_code == 200
    assert whole.json()["choices"][0]["message"] == bare.json()["choices"][0]["message"]
    bogus = [{"role": "user", "content": [part, {"type": "image_url", "image_url": {"url": url, "detail": "max"}}]}]
    error = expect_error(_chat(vlm_http, bogus), 400)
    assert "detail" in error["message"]


def test_too_many_images_then_the_server_still_serves(vlm_http):
    url = data_url(png_bytes(random_image(60, 60, 2)))
    expect_error(_chat(vlm_http, _image_message(url, url, url)), 400, "messages", "too_many_images")
    assert vlm_http.get("/health").status_code == 200
    assert _chat(vlm_http, _image_message(url, url)).status_code == 200
    assert _chat(vlm_http, [{"role": "user", "content": "Hi"}]).status_code == 200


def _fetch(url: str, **settings) -> bytes:
    async def run():
        async with guarded_client(MediaSettings(**settings)) as client:
            return await fetch_image(client, url, MediaSettings(**settings))
    return anyio.run(run)


def test_a_host_that_never_answers_times_out_within_the_limit():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # accepts connections (the kernel's backlog) and never answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/image.png"
        with pytest.raises(APIError, match="took over 0.5 s") as caught:
            _fetch(url, allow_any_domain=True, allow_private=True, fetch_timeout=0.5)
    assert caught.value.code == "media_fetch_timeout"


class _Redirect(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/big.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\0" * 4096)
            return
        self.send_response(302)
        self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/big.png")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_every_redirect_hop_and_the_byte_limit_are_checked():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Redirect)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_port
        with pytest.raises(APIError, match="may not name '127.0.0.1'"):
            _fetch(f"http://localhost:{port}/start", allowed_domains=("localhost",), allow_private=True)
        with pytest.raises(APIError, match="over the limit of 1000 bytes"):
            _fetch(f"http://localhost:{port}/start", allow_any_domain=True, allow_private=True, max_bytes=1000)
        assert len(_fetch(f"http://localhost:{port}/start", allow_any_domain=True, allow_private=True)) == 4096
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_file_urls_read_only_under_the_allowed_directory(vlm_http, media_dir, tmp_path):
    """--allowed-local-media-path: a file there is the same image as its data URL; a path that leaves
    the directory (.. or a symbolic link out of it) is refused like a missing file."""
    local = vlm_http.post("/tokenize", json={"messages": _image_message((media_dir / "cat.png").as_uri())})
    inline = vlm_http.post("/tokenize", json={"messages": _image_message(
        data_url((media_dir / "cat.png").read_bytes()))})
    assert local.status_code == 200 and local.json()["tokens"] == inline.json()["tokens"]
    assert _chat(vlm_http, _image_message((media_dir / "cat.png").as_uri())).status_code == 200
    outside = tmp_path / "secret.png"
    outside.write_bytes((media_dir / "cat.png").read_bytes())
    (media_dir / "link.png").symlink_to(outside)
    for url in (f"file://{media_dir}/../{outside.parent.name}/secret.png", (media_dir / "link.png").as_uri(),
                (media_dir / "missing.png").as_uri()):
        answer = _chat(vlm_http, _image_message(url))
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "media_path_not_allowed", url
