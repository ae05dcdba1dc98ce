"""HTTP plumbing: body size limit, API keys, upload parsing, client-disconnect watching."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets

from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ApiError, error_response, malformed, payload_too_large
from app.schemas import RecognizeJSON

MULTIPART_OVERHEAD = 64 * 1024


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")


def body_limit(content_type: str, max_upload_bytes: int) -> int:
    """Largest acceptable body: base64 in JSON inflates an upload by 4/3."""
    if content_type.startswith("application/json"):
        return max_upload_bytes * 4 // 3 + MULTIPART_OVERHEAD
    return max_upload_bytes + MULTIPART_OVERHEAD


class BodySizeLimit:
    """Refuse oversized bodies early: by Content-Length, or while streaming a chunked body."""

    def __init__(self, app: ASGIApp, max_upload_bytes: int) -> None:
        self.app = app
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        limit = body_limit(content_type, self.max_upload_bytes)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await error_response(payload_too_large(limit))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)


def check_api_key(request: Request, keys: list[str]) -> None:
    """With keys configured, require `Authorization: Bearer <key>`."""
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and any(secrets.compare_digest(token, k) for k in keys):
        return
    raise ApiError(
        401,
        "unauthorized",
        "send a valid API key as 'Authorization: Bearer <key>'",
        {"WWW-Authenticate": "Bearer"},
    )


async def read_image_upload(request: Request, max_bytes: int) -> bytes:
    """The image bytes of a /recognize request: multipart field `image` or JSON `image_base64`."""
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("multipart/form-data"):
        data = await _read_multipart(request, max_bytes)
    elif content_type.startswith("application/json"):
        data = _decode_json_image(await request.body())
    else:
        raise ApiError(
            415,
            "unsupported_media_type",
            "send multipart/form-data with an 'image' file, or JSON with 'image_base64'",
        )
    if not data:
        raise malformed("the image is empty")
    if len(data) > max_bytes:
        raise ApiError(413, "image_too_large", f"the image exceeds {max_bytes} bytes")
    return data


async def _read_multipart(request: Request, max_bytes: int) -> bytes:
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=max_bytes + 1)
    except StarletteHTTPException as exc:
        if exc.status_code == 413:
            raise
        raise malformed(f"the multipart body could not be parsed: {exc.detail}") from None
    try:
        upload = form.get("image")
        if not isinstance(upload, UploadFile):
            raise malformed("the multipart body needs a file field named 'image'")
        return await upload.read(max_bytes + 1)
    finally:
        await form.close()


def _decode_json_image(body: bytes) -> bytes:
    try:
        parsed = RecognizeJSON.model_validate(json.loads(body))
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            raise malformed(f'expected {{"image_base64": ...}}: {exc.errors()[0]["msg"]}') from None
        raise malformed("the body is not valid JSON") from None
    encoded = parsed.image_base64
    if encoded.startswith("data:"):  # accept data URLs from browsers
        encoded = encoded.partition(",")[2]
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise malformed("image_base64 is not valid base64") from None


async def until_disconnected(request: Request) -> None:
    """Return once the client has gone away (the body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Run `work`; cancel it (freeing its batch slot) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ApiError(499, "client_closed_request", "the client disconnected")
