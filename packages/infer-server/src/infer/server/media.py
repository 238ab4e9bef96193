"""Images in chat messages, the OpenAI way: an `image_url` content part's URL in, a decoded Pillow
image and its fingerprint out, or a `MediaError` that says why (a 400 naming the part).

- `data:` URLs (`data:image/png;base64,...`) are decoded here. The fingerprint is the SHA-256 of
  the base64 text itself, as the second design document keys its cache: the same image sent
  twice has the same key without decoding it twice.
- `http(s)` URLs are fetched only when the server allows it (`MediaPolicy`): a server that fetches
  whatever URL a caller names is an SSRF hole. Off by default; `--allowed-media-domains` (vLLM's
  name) lists the hosts it may fetch from, `--allow-remote-media` any public one. Either way a host
  that resolves to a loopback, link-local, private, multicast or reserved address is refused
  unless the list names it; the connection goes to the address that was checked (no second
  lookup for a DNS rebinding to change), redirects are followed by hand and each is checked
  again, and every fetch has a timeout and a byte cap. The fingerprint is the SHA-256 of the
  bytes.
- Decoding: PNG, JPEG and WebP only; the pixel count is read from the header and capped before
  anything is decoded, so a small file that claims 8K x 8K pixels (or more) costs nothing. The
  model's processor resizes what is accepted.
"""

import base64
import binascii
import hashlib
import io
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass

import httpx
from PIL import Image, UnidentifiedImageError

FORMATS = {"PNG", "JPEG", "WEBP"}
# 8K (7680 x 4320) and then some: larger images are refused before decoding, smaller ones are
# resized by the model's processor.
MAX_PIXELS = 64 * 1024 * 1024
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # encoded, per image (OpenAI's limit for an image input)
MAX_IMAGES_PER_REQUEST = 16
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3


class MediaError(ValueError):
    """An image the server will not take: `message` says why, `param` names the content part."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class MediaPolicy:
    """Which remote images the server fetches: none (the default), those of `allowed_domains`
    (host names or addresses; a listed host may be a private address), or with `allow_remote`
    any public one."""

    allowed_domains: frozenset[str] = frozenset()
    allow_remote: bool = False
    timeout_s: float = FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES

    @property
    def fetches(self) -> bool:
        return self.allow_remote or bool(self.allowed_domains)


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, or RGBA where the image has transparency
    fingerprint: str  # hex SHA-256 of the base64 text (data: URLs) or of the fetched bytes
    num_bytes: int  # encoded


def load_image(url: str, param: str, policy: MediaPolicy) -> DecodedImage:
    """The image an `image_url` part names (`param`: where it is, for the error)."""
    if url.startswith("data:"):
        encoded, data = _data_url(url, param)
        return _decode(data, hashlib.sha256(encoded.encode()).hexdigest(), param)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaError(f"image URLs must be data:, http: or https: URLs, got {scheme or url[:20]!r}", param)
    if not policy.fetches:
        raise MediaError(
            "this server does not fetch image URLs (start it with --allowed-media-domains or "
            "--allow-remote-media); send the image as a data: URL",
            param,
        )
    data = _fetch(url, param, policy)
    return _decode(data, hashlib.sha256(data).hexdigest(), param)


def check_image_count(count: int, param: str = "messages") -> None:
    if count > MAX_IMAGES_PER_REQUEST:
        raise MediaError(f"{count} images in one request; at most {MAX_IMAGES_PER_REQUEST}", param)


def _data_url(url: str, param: str) -> tuple[str, bytes]:
    header, comma, encoded = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise MediaError("a data: image URL must be base64: data:image/png;base64,...", param)
    if len(encoded) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise MediaError(f"the image is over {MAX_IMAGE_BYTES} bytes", param)
    try:
        return encoded, base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL's base64 does not decode", param) from None


def _decode(data: bytes, fingerprint: str, param: str) -> DecodedImage:
    if not data:
        raise MediaError("the image is empty (0 bytes)", param)
    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(f"the image is {len(data)} bytes; at most {MAX_IMAGE_BYTES}", param)
    try:
        with Image.open(io.BytesIO(data)) as opened:  # reads the header only
            if opened.format not in FORMATS:
                raise MediaError(f"{opened.format} images are not taken; send PNG, JPEG or WebP", param)
            width, height = opened.size
            if width * height > MAX_PIXELS:
                raise MediaError(f"the image is {width}x{height} pixels; at most {MAX_PIXELS} pixels", param)
            # Decodes; transparency stays for the model's processor (which puts it over white).
            image = opened.convert("RGBA" if _has_alpha(opened) else "RGB")
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError) as error:
        raise MediaError(f"the image does not decode: {error}", param) from None
    if image.width == 0 or image.height == 0:
        raise MediaError("the image has no pixels", param)
    return DecodedImage(image, fingerprint, len(data))


def _has_alpha(image: Image.Image) -> bool:
    return "A" in image.getbands() or "transparency" in image.info


def _fetch(url: str, param: str, policy: MediaPolicy) -> bytes:
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise MediaError(f"image URL {url[:100]!r} is not an http(s) URL with a host", param)
        host = parts.hostname.lower()
        address = _checked_address(
            host, parts.port or (443 if parts.scheme == "https" else 80), param, policy
        )
        # To the address just checked: a second lookup could answer differently (DNS rebinding).
        netloc = f"[{address}]" if ":" in address else address
        if parts.port:
            netloc += f":{parts.port}"
        pinned = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
        try:
            with (
                httpx.Client(timeout=policy.timeout_s, follow_redirects=False) as client,
                client.stream(
                    "GET",
                    pinned,
                    headers={"Host": parts.netloc.rpartition("@")[2]},
                    extensions={"sni_hostname": host},
                ) as response,
            ):
                if response.is_redirect:
                    location = response.headers.get("location", "")
                    url = urllib.parse.urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching the image gave HTTP {response.status_code}", param)
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > policy.max_bytes:
                        raise MediaError(f"the image is over {policy.max_bytes} bytes", param)
                return bytes(body)
        except httpx.TimeoutException:
            raise MediaError(f"fetching the image took over {policy.timeout_s} s", param) from None
        except httpx.HTTPError as error:
            raise MediaError(f"fetching the image failed: {type(error).__name__}", param) from None
    raise MediaError(f"the image URL redirected more than {MAX_REDIRECTS} times", param)


def _checked_address(host: str, port: int, param: str, policy: MediaPolicy) -> str:
    """The address to connect to for `host`, if the policy lets the server fetch from it."""
    listed = host in policy.allowed_domains
    if not listed and not policy.allow_remote:
        raise MediaError(
            f"this server does not fetch images from {host!r} (not in --allowed-media-domains)", param
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise MediaError(f"the image host {host!r} does not resolve", param) from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        internal = not ip.is_global or ip.is_multicast
        if internal and not listed:
            raise MediaError(
                f"the image host {host!r} is an internal address ({ip}); only a host named in "
                "--allowed-media-domains may be one",
                param,
            )
    return addresses[0]
