"""HTTP plumbing: body limits, API keys, body parsing, client-disconnect watching."""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
from collections.abc import Sequence
from typing import TypeVar

from fastapi import Request
from opentelemetry.trace import get_current_span
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import (
    ApiError,
    error_response,
    malformed,
    payload_too_large,
    request_timeout,
    too_many_uploads,
    unsupported_media_type,
    validation_error,
)
from app.schemas import RecognizeJSON
from telemetry import metrics

MULTIPART_OVERHEAD = 64 * 1024
# The request bodies one HTTP process holds at once, counted in full-size uploads
# (`max_upload_bytes` each), from their first byte read until the answer: past them a
# body is refused 503, so that many large uploads, or slow ones, cannot fill its memory.
BODY_BUDGET_UPLOADS = 32
# Errors of a JSON body named one by one in its 422; past this many (a body of a
# million unknown fields) they are counted instead: listing them took seconds of the
# event loop and answered several times the body's size.
MAX_LISTED_ERRORS = 20
URL_SAFE = bytes.maketrans(b"-_", b"+/")  # base64url's two letters, in the standard alphabet
WHITESPACE = b" \t\n\r\x0b\x0c"
Schema = TypeVar("Schema", bound=BaseModel)
# The model each inference route (app/routes.py) serves, by its path.
ROUTE_MODELS = {"/recognize": "formula", "/generate": "image", "/v1/images/generations": "image"}


def body_limit(content_type: str, max_upload_bytes: int, path: str) -> int:
    """Largest acceptable body: base64 in JSON (any body but multipart or a raw image is
    read as JSON) inflates an upload by 4/3. Only /recognize takes an image; the bodies
    of the other routes (a prompt and its parameters, a few KiB) get the envelope's
    allowance alone, so that none can make a process read and parse megabytes."""
    if not path.rstrip("/").endswith("/recognize"):
        return MULTIPART_OVERHEAD
    if _is_raw_image(_media_type(content_type)):
        return max_upload_bytes
    if content_type.startswith("multipart/"):
        return max_upload_bytes + MULTIPART_OVERHEAD
    return max_upload_bytes * 4 // 3 + MULTIPART_OVERHEAD


def _has_body(headers: dict[bytes, bytes]) -> bool:
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") != b"0"


class BodySizeLimit:
    """Bound every request body, in size and in time.

    A body over its limit is refused with 413: by its Content-Length, or as soon as a
    chunked body passes it. A body that has not arrived whole within the request
    timeout of its head is refused with 408. An answer that goes out before its body
    has been read whole (a refusal) first reads the rest within those bounds, so the
    client gets it on a connection that stays open; past them the connection closes,
    so that the rest of a body, sent slowly or never, cannot hold it open.

    The bodies of all requests in the process share one budget (`BODY_BUDGET_UPLOADS`):
    a body holds the bytes of it read so far until its request is answered, and one
    whose next bytes would take the process past it is refused 503 `too_many_uploads`.
    What counts is what came, not what a head declares: a client cannot hold the budget
    with heads alone.
    """

    def __init__(self, app: ASGIApp, max_upload_bytes: int) -> None:
        self.app = app
        self.max_upload_bytes = max_upload_bytes
        self.budget = BODY_BUDGET_UPLOADS * max_upload_bytes
        self.held = 0  # bytes of the budget the bodies of requests in flight hold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        if not _has_body(headers):
            await self.app(scope, receive, send)
            return
        content_type = headers.get(b"content-type", b"").decode("latin-1").lower()
        limit = body_limit(content_type, self.max_upload_bytes, scope["path"])
        # The app factory passes the upload limit only; the timeout is the app's setting.
        timeout_s = scope["app"].state.runtime.settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        received = 0
        unread = True
        refused = False  # over its limit or the budget: the rest is not read
        held = 0  # this body's share of the budget

        def hold(size: int) -> None:
            nonlocal held, refused
            if size <= held:
                return
            if self.held + size - held > self.budget:
                refused = True
                raise too_many_uploads(self.budget)
            self.held += size - held
            held = size

        async def bounded_receive() -> Message:
            nonlocal received, unread, refused
            if not unread:  # the body is in; what comes now is a disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise request_timeout(timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                unread = message.get("more_body", False)  # a refusal then reads no more
                if received > limit:
                    refused = True
                    raise payload_too_large(limit)
                hold(received)
            return message

        async def discard_body() -> bool:
            """Read the rest of the body and drop it; False if it cannot be read whole
            (over the limit, too slow, or the client gone), if it was refused for its
            size or the budget (the rest is not waited for), or if the client waits to
            be told to send it (`Expect: 100-continue`, nothing read yet): it then never
            sends it, and the connection closes without it."""
            if refused:
                return False
            if received == 0 and headers.get(b"expect", b"").lower() == b"100-continue":
                return False
            try:
                while unread:
                    if (await bounded_receive())["type"] != "http.request":
                        return False
            except ApiError:
                return False
            return True

        async def closing_send(message: Message) -> None:
            # An answer before the body was read (a refusal: 401, 503 while not ready):
            # the rest of the body is read and dropped first. Closing a socket that still
            # holds unread bytes makes the kernel reset the connection, and the client
            # would then get no answer at all, not even this one.
            if message["type"] == "http.response.start" and unread and not await discard_body():
                await closed_send(message)
            else:
                await send(message)

        async def closed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                closing = [*message.get("headers", ()), (b"connection", b"close")]
                message = {**message, "headers": closing}
            await send(message)

        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = payload_too_large(limit)
            _refused_before_its_route(scope, error)
            await error_response(error, scope["path"])(scope, receive, closed_send)
            return
        try:
            await self.app(scope, bounded_receive, closing_send)
        finally:
            self.held -= held


def _refused_before_its_route(scope: Scope, error: ApiError) -> None:
    """Record a body refused by its head, before any route ran, as its route records the
    same refusal of a chunked body: its code on the request's span, and counted as
    `invalid` under the route's model, if the route would have read it (a served model,
    a POST, an accepted API key; otherwise it is answered 404, 405 or 401 and not
    counted)."""
    get_current_span().set_attribute("texel.error.code", error.code)
    runtime = scope["app"].state.runtime
    key = ROUTE_MODELS.get(scope["path"])
    if key not in runtime.models or scope["method"] != "POST":
        return
    try:
        check_api_key(Request(scope), runtime.settings.api_keys)
    except ApiError:
        return
    metrics.REJECTED.labels(runtime.model_label(key), "invalid").inc()


class NoSniff:
    """`X-Content-Type-Options: nosniff` on every answer: a browser takes a body as the
    type it is sent as (JSON, a PNG, events), never as a page or a script it guessed
    from bytes a client chose (an echoed field, a prompt, a model's LaTeX)."""

    HEADER = (b"x-content-type-options", b"nosniff")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.HEADER]}
            await send(message)

        await self.app(scope, receive, send_nosniff)


def check_api_key(request: Request, keys: list[str]) -> None:
    """With keys configured, require `Authorization: Bearer <key>`. The header is
    compared as the bytes that came, whatever they are. An empty key (`["", "k"]` in the
    JSON form of the setting, or a variable that was not set) opens nothing: an empty
    token is never a key."""
    if not keys:
        return
    raw = request.headers.get("authorization", "").encode("latin-1")
    scheme, _, token = raw.partition(b" ")
    if (
        scheme.lower() == b"bearer"
        and token
        and any(secrets.compare_digest(token, key.encode()) for key in keys)
    ):
        return
    raise ApiError(
        401,
        "unauthorized",
        "send a valid API key as 'Authorization: Bearer <key>'",
        {"WWW-Authenticate": "Bearer"},
    )


def preferred_type(accept: str, offered: Sequence[str]) -> str:
    """The type of `offered` (in the server's order of preference) that an `Accept` header
    prefers (RFC 9110, 12.5.1): the highest quality, given by the most specific range that
    names the type (`image/png` over `image/*` over `*/*`); then the type a more specific
    range names; then `offered`'s order. The first type without a header, or when the
    header accepts none of them (the answer is then one the client did not ask for,
    rather than none)."""
    ranges: dict[str, float] = {}
    for part in accept.split(","):
        media, *params = (piece.strip() for piece in part.split(";"))
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0  # a malformed weight accepts nothing
        if media:
            ranges[media.lower()] = quality
    best, best_key = offered[0], None
    for order, kind in enumerate(offered):
        names = (kind, kind.split("/")[0] + "/*", "*/*")  # most specific first
        specificity, quality = next(
            ((3 - i, ranges[name]) for i, name in enumerate(names) if name in ranges), (0, 0.0)
        )
        key = (quality, specificity, -order)
        if quality > 0 and (best_key is None or key > best_key):
            best, best_key = kind, key
    return best


def _media_type(content_type: str) -> str:
    """`image/png` of `Image/PNG; charset=...`."""
    return content_type.partition(";")[0].strip().lower()


def _is_json(media_type: str) -> bool:
    """JSON, or no type at all (read as JSON, as clients that send JSON untyped expect)."""
    return media_type in ("", "application/json") or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def _is_raw_image(media_type: str) -> bool:
    """A body that is the image file itself (`curl --data-binary @f.png -H 'Content-Type:
    image/png'`). Its declared type is not trusted: the bytes say what they are."""
    return media_type.startswith("image/") or media_type == "application/octet-stream"


async def read_json(request: Request, schema: type[Schema]) -> Schema:
    """The body as `schema`: 415 for a body that is not JSON, 400 for one that is empty
    or not a JSON object (nested too deep included), 422 for fields that do not match."""
    if not _is_json(_media_type(request.headers.get("content-type", ""))):
        raise unsupported_media_type("JSON with Content-Type: application/json")
    return _parse_json(await request.body(), schema)


def _parse_json(body: bytes, schema: type[Schema]) -> Schema:
    if not body:
        raise malformed("the body is empty; send a JSON object")
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        if exc.error_count() > MAX_LISTED_ERRORS:
            fields = ", ".join(schema.model_fields)
            raise ApiError(
                422,
                "invalid_parameter",
                f"{exc.error_count()} fields of the body are unknown or invalid; "
                f"send only these fields: {fields}",
            ) from None
        errors = exc.errors()
        first = errors[0]
        if first["type"] == "json_invalid":
            reason = first["msg"].removeprefix("Invalid JSON: ")
            raise malformed(f"the body is not valid JSON: {reason}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise malformed("the body is not a JSON object") from None
        raise validation_error(errors) from None


UPLOAD_FORMS = (
    "multipart/form-data with an 'image' file, JSON with 'image_base64', "
    "or the image itself as image/*"
)


async def read_image_upload(request: Request, max_bytes: int) -> bytes:
    """The image bytes of a /recognize request: multipart field `image`, JSON
    `image_base64`, or the body itself sent as `image/*`."""
    media_type = _media_type(request.headers.get("content-type", ""))
    if media_type == "multipart/form-data":
        data = await _read_multipart(request, max_bytes)
    elif _is_raw_image(media_type):
        data = await request.body()
    elif _is_json(media_type):
        body = await request.body()
        if not body:  # no Content-Type either, most likely: any of the three will do
            raise malformed(f"the body is empty; send {UPLOAD_FORMS}")
        data = _decode_base64(_parse_json(body, RecognizeJSON).image_base64)
    else:
        raise unsupported_media_type(UPLOAD_FORMS)
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


def _decode_base64(encoded: str) -> bytes:
    """Standard or URL-safe base64 (RFC 4648), padded or not, wrapped in lines or not (as
    the `base64` command writes it), or a browser's data URL."""
    if encoded.startswith("data:"):
        encoded = encoded.partition(",")[2]
    try:
        # In one pass over bytes: splitting the string at its whitespace made an object of
        # each piece, 20 times the body's memory for base64 spaced every few letters.
        raw = encoded.encode("ascii").translate(URL_SAFE, WHITESPACE).rstrip(b"=")
        return base64.b64decode(raw + b"=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):  # UnicodeEncodeError included: base64 is ASCII
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
