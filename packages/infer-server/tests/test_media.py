"""Image inputs (infer.server.media) against real bytes and a real HTTP server on 127.0.0.1:
data: URLs decode to the pixels Pillow wrote; fetching is off unless allowed; an internal address
is refused unless its host is listed, also behind a redirect; the byte cap, the timeout, the
pixel cap (checked from the header, before decoding) and the formats hold."""

import base64
import contextlib
import hashlib
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from infer.server.media import MAX_PIXELS, MediaError, MediaPolicy, check_image_count, load_image

PARAM = "messages[0].content[1].image_url"


def encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def picture(width: int = 7, height: int = 5) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata(
        [(x * 30 % 256, y * 50 % 256, (x + y) * 10 % 256) for y in range(height) for x in range(width)]
    )
    return image


@pytest.mark.parametrize("image_format", ["PNG", "WEBP"])
def test_a_data_url_gives_the_pixels_that_were_written_and_a_fingerprint_of_its_text(image_format):
    original = picture()
    url = data_url(encoded(original, image_format) if image_format == "PNG" else encoded(original, "WEBP"))
    if image_format == "WEBP":
        original = Image.open(io.BytesIO(encoded(original, "WEBP"))).convert("RGB")  # lossy: as decoded
    decoded = load_image(url, PARAM, MediaPolicy())
    assert decoded.image.mode == "RGB" and list(decoded.image.getdata()) == list(original.getdata())
    assert decoded.fingerprint == hashlib.sha256(url.partition(",")[2].encode()).hexdigest()
    other = load_image(data_url(encoded(picture(7, 6), "PNG")), PARAM, MediaPolicy())
    assert other.fingerprint != decoded.fingerprint


@pytest.mark.parametrize(
    "url, says",
    [
        ("data:image/png;base64,", "empty"),
        ("data:image/png;base64,!!!notbase64", "does not decode"),
        ("data:image/png," + "x" * 10, "must be base64"),
        (data_url(b"\x89PNG\r\n\x1a\n garbage"), "does not decode"),
        (data_url(encoded(picture(), "BMP"), "image/bmp"), "BMP images are not taken"),
        ("ftp://example.com/a.png", "data:, http: or https:"),
        ("https://example.com/a.png", "does not fetch image URLs"),
    ],
)
def test_bad_images_are_refused_naming_the_part(url, says):
    with pytest.raises(MediaError, match=says) as refused:
        load_image(url, PARAM, MediaPolicy())
    assert refused.value.param == PARAM


def test_transparency_is_kept_for_the_models_processor():
    rgba = Image.new("RGBA", (3, 2), (10, 20, 30, 0))
    decoded = load_image(data_url(encoded(rgba, "PNG")), PARAM, MediaPolicy())
    assert decoded.image.mode == "RGBA" and decoded.image.getpixel((0, 0)) == (10, 20, 30, 0)


def test_too_many_pixels_are_refused_from_the_header_without_decoding():
    side = int(MAX_PIXELS**0.5) + 1
    huge = encoded(Image.new("1", (side, side)), "PNG")  # a few kB of zeros
    assert len(huge) < 1_000_000
    started = time.perf_counter()
    with pytest.raises(MediaError, match=f"{side}x{side} pixels"):
        load_image(data_url(huge), PARAM, MediaPolicy())
    assert time.perf_counter() - started < 1.0  # decoding it would take seconds and 200+ MB


def test_more_images_than_a_request_may_hold_are_refused():
    check_image_count(16)
    with pytest.raises(MediaError, match="17 images"):
        check_image_count(17)


class ImageServer(BaseHTTPRequestHandler):
    png = encoded(picture(), "PNG")

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/ok.png":
            self._send(200, self.png)
        elif self.path == "/big.png":
            self._send(200, self.png + b"\0" * 4096)
        elif self.path == "/slow.png":
            time.sleep(2)
            # The client gave up first, as the timeout test means it to.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._send(200, self.png)
        elif self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.partition("=")[2])
            self.end_headers()
        elif self.path == "/host":
            self._send(200, self.headers["Host"].encode())
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class JoinedHTTPServer(ThreadingHTTPServer):
    # server_close() joins the handler threads, so none outlives this file: a slow handler
    # still running into the next test file's time once printed a traceback there, and CPython
    # 3.11's ast state is not thread-safe (a traceback's caret lines parse with ast).
    daemon_threads = False


@pytest.fixture(scope="module")
def image_server():
    server = JoinedHTTPServer(("127.0.0.1", 0), ImageServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_listed_host_is_fetched_and_fingerprinted_by_its_bytes(image_server):
    base, _ = image_server
    decoded = load_image(f"{base}/ok.png", PARAM, MediaPolicy(allowed_domains=frozenset({"127.0.0.1"})))
    assert list(decoded.image.getdata()) == list(picture().getdata())
    assert decoded.fingerprint == hashlib.sha256(ImageServer.png).hexdigest()
    # Redirects on the listed host are followed.
    redirected = load_image(
        f"{base}/redirect?to=/ok.png", PARAM, MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}))
    )
    assert redirected.fingerprint == decoded.fingerprint


def test_internal_addresses_unlisted_hosts_and_redirects_to_them_are_refused(image_server):
    base, port = image_server
    anywhere_public = MediaPolicy(allow_remote=True)
    with pytest.raises(MediaError, match="internal address"):
        load_image(f"{base}/ok.png", PARAM, anywhere_public)
    with pytest.raises(MediaError, match="not in --allowed-media-domains"):
        load_image(
            f"http://localhost:{port}/ok.png", PARAM, MediaPolicy(allowed_domains=frozenset({"a.example"}))
        )
    # The listed host redirects to a host that is not listed (the same machine by another name).
    listed = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}))
    with pytest.raises(MediaError, match="'localhost'"):
        load_image(f"{base}/redirect?to=http://localhost:{port}/ok.png", PARAM, listed)


def test_the_byte_cap_and_the_timeout_hold(image_server):
    base, _ = image_server
    capped = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), max_bytes=len(ImageServer.png) + 100)
    assert load_image(f"{base}/ok.png", PARAM, capped).num_bytes == len(ImageServer.png)
    with pytest.raises(MediaError, match="over"):
        load_image(f"{base}/big.png", PARAM, capped)
    impatient = MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}), timeout_s=0.5)
    with pytest.raises(MediaError, match="took over 0.5 s"):
        load_image(f"{base}/slow.png", PARAM, impatient)
