"""The exception tree (drawn in docs/errors.md): everything tensorrpc raises derives from
[`TensorRPCError`][tensorrpc.TensorRPCError]. Errors that cross the wire travel as an
[`ErrorCode`][tensorrpc.ErrorCode] plus text, rebuilt by `error_from_wire`, never pickled.
"""

from __future__ import annotations

import ast
import re
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from tensorrpc._text import peer_text

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "BroadcastError",
    "CallError",
    "CallTimeoutError",
    "ClosedError",
    "ConnectError",
    "DecodeError",
    "DecompressionError",
    "DrainingError",
    "EncodeError",
    "EngineDeadError",
    "EngineNotFoundError",
    "EnginesUnavailableError",
    "ErrorCode",
    "HandshakeRejectedError",
    "InvalidArgumentError",
    "LocalProtocolError",
    "MetadataError",
    "MethodNotFoundError",
    "NoCallContextError",
    "OverloadedError",
    "PeerUnreachableError",
    "PermissionDeniedError",
    "ProtocolError",
    "RemoteError",
    "RemoteProtocolError",
    "SerializationError",
    "ServiceDefinitionError",
    "TensorRPCError",
    "TensorTransportError",
    "TransportError",
    "ValidationError",
    "error_from_wire",
]


class TensorRPCError(Exception):
    """Root of every exception raised by tensorrpc."""


class ServiceDefinitionError(TensorRPCError, TypeError):
    """A class decorated with ``@service``/``@rpc`` cannot be turned into a service spec.

    Raised at decoration time, naming the method, the parameter and the offending type.
    """


class ProtocolError(TensorRPCError):
    """A message violated the wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class MetadataError(LocalProtocolError, ValueError):
    """Call metadata we were asked to send breaks a rule: a key that is not lowercase
    ``[a-z0-9._-]`` or is reserved, a value that is not a ``str`` or holds a control
    character, or more keys or bytes than the bounds allow (docs/context.md)."""


class SerializationError(TensorRPCError):
    """A value could not be turned into frames, or frames into a value."""


class EncodeError(SerializationError):
    """A value cannot be encoded: unsupported type or dtype, or over a size limit."""


class DecodeError(SerializationError):
    """Bytes from the wire cannot be decoded (malformed, forged or over a limit)."""


class DecompressionError(DecodeError):
    """A compressed payload or tensor frame from the wire was refused.

    Its frame is malformed, does not declare its decompressed size, declares another size
    than the tensor's or one over the receiver's limits, expands beyond what it declared
    (a decompression bomb), or names a codec this side did not offer. Nothing beyond the
    declared size is ever allocated. An engine answers such a CALL with ``DECODE`` (the
    caller sees a [`DecodeError`][tensorrpc.DecodeError]) and keeps serving.
    """


class ValidationError(SerializationError):
    """A value does not match the type declared by the method signature."""

    def __init__(
        self,
        message: str,
        *,
        method: str = "",
        path: str = "",
        expected: str = "",
        field_path: Sequence[str | int] = (),
    ) -> None:
        super().__init__(message)
        #: ``Service.method`` the value belongs to ("" when unknown).
        self.method = method
        #: Where in the request or response the bad value sits, e.g. ``req.items[3].x``.
        self.path = path
        #: The same place as data: names of fields and parameters (``str``), list and tuple
        #: indices (``int``) and map keys (``str``, or ``int`` for ``dict[int, T]``), e.g.
        #: ``["req", "items", 3, "x"]``; empty when unknown.
        self.field_path: list[str | int] = list(field_path)
        #: A description of the expected type.
        self.expected = expected


class TransportError(TensorRPCError):
    """The peer or the network broke (as opposed to [`ClosedError`][tensorrpc.ClosedError])."""


class ConnectError(TransportError):
    """A connection could not be made or kept."""


class HandshakeRejectedError(ConnectError):
    """The handshake was refused; ``reason`` says what differs."""

    def __init__(self, message: str, *, reason: str = "", engine_id: str = "") -> None:
        super().__init__(message)
        #: Why the handshake was refused (schema mismatch, duplicate id, version...).
        self.reason = reason
        #: The engine concerned, when known.
        self.engine_id = engine_id


class EngineDeadError(TransportError):
    """The engine died, said BYE, or stopped answering heartbeats while calls were in flight."""

    def __init__(self, message: str, *, engine_id: str = "") -> None:
        super().__init__(message)
        #: The engine that died.
        self.engine_id = engine_id


class EnginesUnavailableError(TransportError, TimeoutError):
    """Not enough engines joined in time; names the engines that were refused and why."""

    def __init__(self, message: str, *, rejected: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        #: engine id -> reason, for every engine refused at handshake.
        self.rejected: dict[str, str] = dict(rejected or {})


class PeerUnreachableError(TransportError):
    """A ROUTER socket was asked to send to a routing id that is not connected (any more)."""

    def __init__(self, message: str, *, peer: bytes = b"") -> None:
        super().__init__(message)
        #: The routing id the message was addressed to.
        self.peer = peer


class TensorTransportError(TransportError):
    """A tensor transport failed to place or fetch a tensor."""


class CallError(TensorRPCError):
    """One call failed."""


class RemoteError(CallError):
    """The remote handler raised an exception."""

    def __init__(
        self, remote_type: str, message: str, remote_traceback: str = "", *, code: int = 1
    ) -> None:
        super().__init__(f"{remote_type}: {message}")
        #: The ERROR code it came with: ``REMOTE``, ``BAD_RESULT`` or ``INTERNAL``.
        self.code = ErrorCode(code)
        #: Qualified name of the exception type raised on the engine.
        self.remote_type = remote_type
        #: ``str()`` of the remote exception.
        self.message = message
        #: The formatted remote traceback (text, never a pickled object).
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = f"{self.remote_type}: {self.message}"
        if self.remote_traceback:
            text += "\n\nRemote traceback:\n" + self.remote_traceback
        return text


class MethodNotFoundError(CallError):
    """The engine has no such method."""


class InvalidArgumentError(CallError):
    """The engine refused the arguments (wrong type, missing, malformed)."""

    def __init__(self, message: str, path: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        #: Where the bad value sits, as the engine's ERROR said: ``("req", "items", 3)``
        #: (empty when the refusal names no value).
        self.path = path


class CallTimeoutError(CallError, TimeoutError):
    """The call's deadline passed."""


class OverloadedError(CallError):
    """The engine refused the call for capacity: its queue was full, or every worker was
    busy and the call asked not to wait (docs/protocol.md, ERROR codes)."""


class EngineNotFoundError(CallError):
    """The targeted engine is not live; ``live`` lists the engines that are."""

    def __init__(self, message: str, *, live: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: Engine ids that were live when the call was made.
        self.live = live


class DrainingError(CallError):
    """The engine is shutting down and refuses new calls."""


class PermissionDeniedError(CallError):
    """The call was refused: an interceptor (an auth check, say) or the handler said no.

    Raise it in an engine interceptor or handler to answer ``PERMISSION_DENIED``; the
    caller gets this exception with the message. A client interceptor raises it to
    refuse a call before it is sent.
    """


class BroadcastError(CallError):
    """At least one engine failed a broadcast; ``results`` holds every engine's outcome."""

    def __init__(self, message: str, *, results: Mapping[str, Any]) -> None:
        super().__init__(message)
        #: engine id -> the result, or the exception that engine's call raised.
        self.results: dict[str, Any] = dict(results)

    @property
    def errors(self) -> dict[str, BaseException]:
        """The engines that failed, with their exceptions."""
        return {k: v for k, v in self.results.items() if isinstance(v, BaseException)}


class NoCallContextError(TensorRPCError, LookupError):
    """`tensorrpc.call_context` was called outside the call of a handler (or in a
    batched handler, which serves several calls: see ``BatchItem.context``)."""


class ClosedError(TensorRPCError):
    """The client or server was closed by its owner and then used."""


class ErrorCode(IntEnum):
    """Error classes that travel in an ERROR message (see [Wire protocol](protocol.md))."""

    #: The handler raised; ``type``/``message``/``traceback`` describe it.
    REMOTE = 1
    #: No such method on this service.
    METHOD_NOT_FOUND = 2
    #: Arguments failed validation on the engine.
    INVALID_ARGUMENT = 3
    #: The engine could not decode the frames.
    DECODE = 4
    #: The deadline had passed (before or while running).
    DEADLINE_EXCEEDED = 5
    #: Refused for capacity: the queue is full, or every worker is busy and the CALL said
    #: ``NO_WAIT``.
    OVERLOADED = 6
    #: The engine is draining and refuses new calls.
    DRAINING = 7
    #: A tensor transport failed on the engine.
    TENSOR_TRANSPORT = 8
    #: The handler's result failed validation or encoding on the engine.
    BAD_RESULT = 9
    #: Anything else that went wrong inside the engine.
    INTERNAL = 10
    #: The message violated the protocol (wrong frames, unknown kind, ...).
    PROTOCOL = 11
    #: An interceptor or the handler refused the call (`PermissionDeniedError`).
    PERMISSION_DENIED = 12


#: One segment of a `ValidationError.path` after its root: ``.name``, ``[3]``, ``['key']``.
_SEGMENT = re.compile(r"""\.([^.\[]+)|\[(\d+)\]|\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")\]""")


def path_parts(path: str) -> tuple[str | int, ...]:
    """``"req.items[3].tags['k']"`` as ``("req", "items", 3, "tags", "k")``: the
    structured path ERROR carries (docs/protocol.md §4, ErrorInfo)."""
    root = re.match(r"[^.\[]*", path)
    end = root.end() if root else 0
    parts: list[str | int] = [path[:end]] if end else []
    for match in _SEGMENT.finditer(path, end):
        name, index, key = match.groups()
        parts.append(name if name is not None else int(index) if index else ast.literal_eval(key))
    return tuple(parts)


def error_from_wire(
    code: int,
    remote_type: str,
    message: str,
    traceback: str,
    path: tuple[str | int, ...] = (),
) -> TensorRPCError:
    """Rebuild the local exception for an ERROR message received from an engine.

    The engine's texts are escaped here (`_text.peer_text`, lines kept): whoever prints
    or logs the exception shows no control character the engine chose.
    """
    remote_type = peer_text(remote_type, None)
    message = peer_text(message, None, lines=True)
    traceback = peer_text(traceback, None, lines=True)
    if code == ErrorCode.INVALID_ARGUMENT:
        return InvalidArgumentError(message, path)
    if code == ErrorCode.DECODE:
        return DecodeError(f"engine could not decode the call: {message}")
    simple = _BY_CODE.get(code)
    if simple is not None:
        return simple(message)
    if code == ErrorCode.REMOTE:
        return RemoteError(remote_type, message, traceback)
    if code == ErrorCode.BAD_RESULT:
        return RemoteError(remote_type or "BadResult", message, traceback, code=code)
    return RemoteError(remote_type or "InternalError", message, traceback, code=ErrorCode.INTERNAL)


#: The errors built from the ERROR's message alone.
_BY_CODE: dict[int, type[TensorRPCError]] = {
    ErrorCode.METHOD_NOT_FOUND: MethodNotFoundError,
    ErrorCode.DEADLINE_EXCEEDED: CallTimeoutError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.DRAINING: DrainingError,
    ErrorCode.TENSOR_TRANSPORT: TensorTransportError,
    ErrorCode.PROTOCOL: RemoteProtocolError,
    ErrorCode.PERMISSION_DENIED: PermissionDeniedError,
}

# Tracebacks and reprs name the public path (tensorrpc.ValidationError), not this private
# module. Only exceptions and ErrorCode: other classes keep their module, where
# typing.get_type_hints() looks up their string annotations.
for _value in list(globals().values()):
    if (
        isinstance(_value, type)
        and issubclass(_value, BaseException | ErrorCode)
        and _value.__module__ == __name__
    ):
        _value.__module__ = "tensorrpc"
del _value
