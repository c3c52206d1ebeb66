"""One server interceptor that maps typed errors to gRPC status codes.

A `ServiceError` (services/errors.py) ends the RPC with the status its class names and its
message. Anything else is a bug: logged with its traceback and reported as INTERNAL. Services
never call `context.abort` for domain errors themselves. Requests are decoded by
`services.decoding.safe_deserializer`, so one that does not parse (invalid UTF-8 in a string
field, bad wire format) reaches the handler as `Malformed` and ends as INVALID_ARGUMENT, in a
unary request or any message of a request stream, before the service sees it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.decoding import Malformed, safe_deserializer
from services.errors import InvalidArgument, ServiceError

log = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError) and exc.code in grpc.StatusCode.__members__:
        return grpc.StatusCode[exc.code], exc.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    await context.abort(code, message)


def _checked(request: Any) -> Any:
    """A decoded request, or InvalidArgument for one that did not decode."""
    if isinstance(request, Malformed):
        raise InvalidArgument(request.message)
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str,
                is_stream_in: bool) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _checked_stream(request) if is_stream_in else _checked(request)
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method)
    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]], method: str, is_stream_in: bool
                 ) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = _checked_stream(request) if is_stream_in else _checked(request)
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method)
    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler of the server (unary or streaming responses)."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        ser = {"request_deserializer": safe_deserializer(handler.request_deserializer),
               "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, False), **ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method, True), **ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, False), **ser)
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method, True), **ser)
