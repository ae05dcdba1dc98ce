"""Input errors raised by model adapters.

Each carries a stable `code` and a message a caller can act on; the HTTP layer
maps the classes to statuses in one place (`app/errors.py`).
"""

from __future__ import annotations


class InputError(ValueError):
    """The request's content cannot be processed by the model."""

    code = "invalid_input"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, by /generate's name, where one is


class UnsupportedImage(InputError):
    code = "unsupported_image"


class ImageTooLarge(InputError):
    code = "image_too_large"


class CorruptImage(InputError):
    code = "corrupt_image"


class InvalidParameter(InputError):
    code = "invalid_parameter"
