"""Images named by URL in chat content parts, loaded in the frontend: `data:` base64 URLs,
http(s) URLs fetched with a timeout and a size limit, and local files only under
`--allowed-local-media-path`. Every failure is a BadRequestError (400) naming the part."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import unquote, urlparse

from zllm.config import EngineConfig
from zllm.frontend.multimodal import decode_image, read_data_url
from zllm.frontend.openai.protocol import BadRequestError


async def load_images(urls: list[str], config: EngineConfig) -> list:
    """The PIL images of `urls`, in order (fetched concurrently; decoded off the loop)."""
    payloads = await asyncio.gather(*(_read(index, url, config) for index, url in enumerate(urls)))
    loop = asyncio.get_running_loop()
    return [
        await loop.run_in_executor(None, _as_bad_request, decode_image, data, index)
        for index, data in enumerate(payloads)
    ]


def _as_bad_request(function, *args):
    """A ValueError of zllm/frontend/multimodal.py's readers as a 400."""
    try:
        return function(*args)
    except ValueError as error:
        raise BadRequestError(str(error), "messages") from None


async def _read(index: int, url: str, config: EngineConfig) -> bytes:
    if not isinstance(url, str) or not url:
        raise BadRequestError(f"messages: image {index}: image_url.url must be a non-empty string", "messages")
    if url.startswith("data:"):
        data = _as_bad_request(read_data_url, url, index)
    elif url.startswith(("http://", "https://")):
        data = await _fetch(index, url, config)
    else:
        data = await asyncio.get_running_loop().run_in_executor(None, _read_local, index, url, config)
    if len(data) > config.max_media_bytes:
        raise BadRequestError(f"messages: image {index} is larger than {config.max_media_bytes} bytes", "messages")
    return data


async def _fetch(index: int, url: str, config: EngineConfig) -> bytes:
    import aiohttp

    limit = config.max_media_bytes
    timeout = aiohttp.ClientTimeout(total=config.media_fetch_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise BadRequestError(f"messages: image {index}: {url} answered HTTP {response.status}", "messages")
            if (response.content_length or 0) > limit:
                raise BadRequestError(f"messages: image {index} at {url} is larger than {limit} bytes", "messages")
            data = await response.content.read(limit + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        reason = "timed out" if isinstance(error, asyncio.TimeoutError) else str(error) or type(error).__name__
        raise BadRequestError(f"messages: image {index}: cannot fetch {url}: {reason}", "messages") from None
    if len(data) > limit:
        raise BadRequestError(f"messages: image {index} at {url} is larger than {limit} bytes", "messages")
    return data


def _read_local(index: int, url: str, config: EngineConfig) -> bytes:
    """A file:// URL or a path, only inside --allowed-local-media-path (after resolving links)."""
    allowed = config.allowed_local_media_path
    if allowed is None:
        raise BadRequestError(
            f"messages: image {index}: local files are not served (start with --allowed-local-media-path)", "messages"
        )
    path = Path(unquote(urlparse(url).path) if url.startswith("file://") else url).resolve()
    root = Path(allowed).resolve()
    if not path.is_relative_to(root):
        raise BadRequestError(f"messages: image {index}: {url} is outside the allowed media folder", "messages")
    try:
        with path.open("rb") as f:
            return f.read(config.max_media_bytes + 1)
    except OSError as error:
        raise BadRequestError(f"messages: image {index}: cannot read {url}: {error.strerror}", "messages") from None
