"""Reading a JSON request body: the size limit, the read deadline, the Content-Encoding, the
depth bound, and decoding a large body off the event loop. Every route that takes a body reads
it here, so no route is easier to knock over than another."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from tandem.models.chat import MAX_JSON_DEPTH, nested_deeper
from tandem.server.errors import ApiError, bad_request

DECODE_INLINE_BYTES = 64 * 1024  # a larger body is decoded on a worker thread


async def read_json(request: web.Request, limit: int, read_timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object: 413 past max_body_bytes, 408 (and the connection closed) when
    it is not all there within request_read_timeout_s, 400 when it is not a JSON object."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"the body has {request.content_length} bytes; the limit is {limit}",
                       code="request_too_large", close=True)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(read_timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the body is over the limit of {limit} bytes",
                                   code="request_too_large", close=True)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, "the request was not received in time", code="request_timeout",
                       close=True) from None
    except web.RequestPayloadError:
        # aiohttp decodes a Content-Encoding as it reads: a body that does not match it
        # (gzip over plain bytes) fails here.
        raise ApiError(400, "the body could not be read (does it match its Content-Encoding?)",
                       code="invalid_body", close=True) from None
    raw = b"".join(chunks)
    body = _decode(raw) if len(raw) <= DECODE_INLINE_BYTES else \
        await asyncio.to_thread(_decode, raw)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return body


def _decode(raw: bytes) -> Any:
    """The body decoded and its depth bounded, before anything that recurses reads it."""
    try:
        body = msgspec.json.decode(raw)
        deep = nested_deeper(body, MAX_JSON_DEPTH)
    except msgspec.DecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # msgspec's own limit, far past ours: the same answer
        deep = True
    if deep:
        raise bad_request(f"the body nests more than {MAX_JSON_DEPTH} levels deep",
                          code="nested_too_deeply")
    return body
