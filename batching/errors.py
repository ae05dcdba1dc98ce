"""Why the batcher did not produce a result for a request."""

from __future__ import annotations


class BatchingError(Exception):
    """Base class: a request was refused or failed inside the batcher."""

    code = "batching_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(BatchingError):
    """`max_queue` requests already wait; the caller should retry later."""

    code = "queue_full"

    def __init__(self, waiting: int, retry_after_s: float) -> None:
        super().__init__(
            f"{waiting} {'request is' if waiting == 1 else 'requests are'} already waiting; "
            f"retry in about {retry_after_s:.0f} s"
        )
        self.retry_after_s = retry_after_s
        self.waiting = waiting


class DeadlineExceeded(BatchingError):
    code = "deadline_exceeded"


class Cancelled(BatchingError):
    """The caller went away; nobody reads this, but metrics count it."""

    code = "cancelled"


class Draining(BatchingError):
    """The batcher is shutting down and accepts no new requests."""

    code = "draining"


# The message of a cancellation by the server's drain rather than by the caller
# (`task.cancel(CUT_OFF)`): the batcher counts it as `draining`, not `cancelled`.
CUT_OFF = "draining"


def cut_off(exc: BaseException) -> bool:
    """Whether a cancellation came from the server's drain, not from its caller."""
    return exc.args[:1] == (CUT_OFF,)


class BatchFailed(BatchingError):
    """The batch this request ran in raised; other batches are unaffected."""

    code = "batch_failed"


class OutOfMemory(Exception):
    """Raised by a runner when a batch does not fit on its device.

    The batcher splits the batch in halves and retries each; a single request
    that still does not fit fails with `BatchFailed`.
    """
