"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

# The status of each kind of failure and the ``type`` OpenAI's API gives it.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request the server answers with an error: its status, one-line message, and what it concerns.

    Args:
        status: the HTTP status.
        message: one line for the caller.
        param: the body field at fault, if one is.
        code: a short machine-readable reason (``"queue_full"``, ``"model_not_found"``, ...).
        retry_after: seconds after which the same request may succeed (sent as ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, " ".join(message.split()), param, code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """The response's extra headers."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        """The JSON body of the response."""
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    """400: a setting the server cannot honour."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


class GenerationFailed(RuntimeError):
    """A request ran and failed: every particle died, or its program ended it in error."""


def failed(message: str) -> APIError:
    """500: the request ran and produced no output (its message says why)."""
    return APIError(500, message or "generation failed", code="generation_failed")
