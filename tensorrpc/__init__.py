"""tensorrpc: asyncio-native RPC for tensor-heavy Python services.

Declare a service with ``@service``/``@rpc`` and type hints, run it with
[`serve`][tensorrpc.serve] in any number of engine processes, and call it through one
[`Client`][tensorrpc.Client] that multiplexes every engine over a single ZMQ ROUTER
socket. Payloads are msgpack (ormsgpack); tensors travel as zero-copy out-of-band frames
or through torch shared memory. Nothing is ever pickled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Names are imported from their modules on first use (PEP 562 ``__getattr__`` below), so
# that ``import tensorrpc`` (and ``tensorrpc --version``) costs milliseconds, not the
# seconds of torch's import; type checkers and the API reference read the imports here.
if TYPE_CHECKING:
    from tensorrpc._batching import Batching, Continuous
    from tensorrpc._blocking import BlockingCallView, BlockingClient, BlockingStream, BlockingStub
    from tensorrpc._client import (
        CallOptions,
        CallStream,
        CallView,
        Client,
        ClientStatistics,
        EngineInfo,
        EngineStatistics,
    )
    from tensorrpc._codec import CodecConfig
    from tensorrpc._context import CallContext, call_context
    from tensorrpc._exceptions import (
        BroadcastError,
        CallError,
        CallTimeoutError,
        ClosedError,
        ConnectError,
        DecodeError,
        DrainingError,
        EncodeError,
        EngineDeadError,
        EngineNotFoundError,
        EnginesUnavailableError,
        ErrorCode,
        HandshakeRejectedError,
        InvalidArgumentError,
        LocalProtocolError,
        MetadataError,
        MethodNotFoundError,
        NoCallContextError,
        OverloadedError,
        PeerUnreachableError,
        PermissionDeniedError,
        ProtocolError,
        RemoteError,
        RemoteProtocolError,
        SerializationError,
        ServiceDefinitionError,
        TensorRPCError,
        TensorTransportError,
        TransportError,
        ValidationError,
    )
    from tensorrpc._interceptors import ClientCall, ClientInterceptor, ServerInterceptor
    from tensorrpc._observe import CallObservation, Observer
    from tensorrpc._protocol import PROTOCOL_VERSION
    from tensorrpc._release import release_later, set_release_threshold
    from tensorrpc._security import (
        CurveClientConfig,
        CurveConfig,
        CurveKeyPair,
        CurveServerConfig,
        generate_keypair,
        load_keypair,
        load_public_key,
        load_public_keys,
        save_keypair,
    )
    from tensorrpc._server import PeerStatistics, Server, ServerConfig, ServerStatistics, serve
    from tensorrpc._service import BatchSpec, MethodSpec, ServiceSpec, describe, rpc, service
    from tensorrpc._stub import Stub
    from tensorrpc._typed_stub import StreamingMethod, TypedStub, UnaryMethod, streaming, unary
    from tensorrpc._zmq import SocketOptions
    from tensorrpc.batching import BatchContext, BatchItem, current_batch
    from tensorrpc.transports import (
        TorchShmStatistics,
        TransportCounters,
        TransportName,
        TransportStatistics,
    )
    from tensorrpc.transports._shared import share, shared_empty

__version__ = "0.1.0"

#: Where each public name is defined.
_EXPORTS: dict[str, str] = {
    "Batching": "tensorrpc._batching",
    "Continuous": "tensorrpc._batching",
    "BlockingCallView": "tensorrpc._blocking",
    "BlockingClient": "tensorrpc._blocking",
    "BlockingStream": "tensorrpc._blocking",
    "BlockingStub": "tensorrpc._blocking",
    "CallOptions": "tensorrpc._client",
    "CallStream": "tensorrpc._client",
    "CallView": "tensorrpc._client",
    "Client": "tensorrpc._client",
    "ClientStatistics": "tensorrpc._client",
    "EngineInfo": "tensorrpc._client",
    "EngineStatistics": "tensorrpc._client",
    "CodecConfig": "tensorrpc._codec",
    "CallContext": "tensorrpc._context",
    "call_context": "tensorrpc._context",
    "BroadcastError": "tensorrpc._exceptions",
    "CallError": "tensorrpc._exceptions",
    "CallTimeoutError": "tensorrpc._exceptions",
    "ClosedError": "tensorrpc._exceptions",
    "ConnectError": "tensorrpc._exceptions",
    "DecodeError": "tensorrpc._exceptions",
    "DrainingError": "tensorrpc._exceptions",
    "EncodeError": "tensorrpc._exceptions",
    "EngineDeadError": "tensorrpc._exceptions",
    "EngineNotFoundError": "tensorrpc._exceptions",
    "EnginesUnavailableError": "tensorrpc._exceptions",
    "ErrorCode": "tensorrpc._exceptions",
    "HandshakeRejectedError": "tensorrpc._exceptions",
    "InvalidArgumentError": "tensorrpc._exceptions",
    "LocalProtocolError": "tensorrpc._exceptions",
    "MetadataError": "tensorrpc._exceptions",
    "MethodNotFoundError": "tensorrpc._exceptions",
    "NoCallContextError": "tensorrpc._exceptions",
    "OverloadedError": "tensorrpc._exceptions",
    "PeerUnreachableError": "tensorrpc._exceptions",
    "PermissionDeniedError": "tensorrpc._exceptions",
    "ProtocolError": "tensorrpc._exceptions",
    "RemoteError": "tensorrpc._exceptions",
    "RemoteProtocolError": "tensorrpc._exceptions",
    "SerializationError": "tensorrpc._exceptions",
    "ServiceDefinitionError": "tensorrpc._exceptions",
    "TensorRPCError": "tensorrpc._exceptions",
    "TensorTransportError": "tensorrpc._exceptions",
    "TransportError": "tensorrpc._exceptions",
    "ValidationError": "tensorrpc._exceptions",
    "ClientCall": "tensorrpc._interceptors",
    "ClientInterceptor": "tensorrpc._interceptors",
    "ServerInterceptor": "tensorrpc._interceptors",
    "CallObservation": "tensorrpc._observe",
    "Observer": "tensorrpc._observe",
    "PROTOCOL_VERSION": "tensorrpc._protocol",
    "release_later": "tensorrpc._release",
    "set_release_threshold": "tensorrpc._release",
    "CurveClientConfig": "tensorrpc._security",
    "CurveConfig": "tensorrpc._security",
    "CurveKeyPair": "tensorrpc._security",
    "CurveServerConfig": "tensorrpc._security",
    "generate_keypair": "tensorrpc._security",
    "load_keypair": "tensorrpc._security",
    "load_public_key": "tensorrpc._security",
    "load_public_keys": "tensorrpc._security",
    "save_keypair": "tensorrpc._security",
    "PeerStatistics": "tensorrpc._server",
    "Server": "tensorrpc._server",
    "ServerConfig": "tensorrpc._server",
    "ServerStatistics": "tensorrpc._server",
    "serve": "tensorrpc._server",
    "BatchSpec": "tensorrpc._service",
    "MethodSpec": "tensorrpc._service",
    "ServiceSpec": "tensorrpc._service",
    "describe": "tensorrpc._service",
    "rpc": "tensorrpc._service",
    "service": "tensorrpc._service",
    "Stub": "tensorrpc._stub",
    "StreamingMethod": "tensorrpc._typed_stub",
    "TypedStub": "tensorrpc._typed_stub",
    "UnaryMethod": "tensorrpc._typed_stub",
    "streaming": "tensorrpc._typed_stub",
    "unary": "tensorrpc._typed_stub",
    "SocketOptions": "tensorrpc._zmq",
    "TorchShmStatistics": "tensorrpc.transports",
    "TransportCounters": "tensorrpc.transports",
    "TransportName": "tensorrpc.transports",
    "TransportStatistics": "tensorrpc.transports",
    "BatchContext": "tensorrpc.batching",
    "BatchItem": "tensorrpc.batching",
    "current_batch": "tensorrpc.batching",
    "share": "tensorrpc.transports._shared",
    "shared_empty": "tensorrpc.transports._shared",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "PROTOCOL_VERSION",
    "BatchContext",
    "BatchItem",
    "BatchSpec",
    "Batching",
    "BlockingCallView",
    "BlockingClient",
    "BlockingStream",
    "BlockingStub",
    "BroadcastError",
    "CallContext",
    "CallError",
    "CallObservation",
    "CallOptions",
    "CallStream",
    "CallTimeoutError",
    "CallView",
    "Client",
    "ClientCall",
    "ClientInterceptor",
    "ClientStatistics",
    "ClosedError",
    "CodecConfig",
    "ConnectError",
    "Continuous",
    "CurveClientConfig",
    "CurveConfig",
    "CurveKeyPair",
    "CurveServerConfig",
    "DecodeError",
    "DrainingError",
    "EncodeError",
    "EngineDeadError",
    "EngineInfo",
    "EngineNotFoundError",
    "EngineStatistics",
    "EnginesUnavailableError",
    "ErrorCode",
    "HandshakeRejectedError",
    "InvalidArgumentError",
    "LocalProtocolError",
    "MetadataError",
    "MethodNotFoundError",
    "MethodSpec",
    "NoCallContextError",
    "Observer",
    "OverloadedError",
    "PeerStatistics",
    "PeerUnreachableError",
    "PermissionDeniedError",
    "ProtocolError",
    "RemoteError",
    "RemoteProtocolError",
    "SerializationError",
    "Server",
    "ServerConfig",
    "ServerInterceptor",
    "ServerStatistics",
    "ServiceDefinitionError",
    "ServiceSpec",
    "SocketOptions",
    "StreamingMethod",
    "Stub",
    "TensorRPCError",
    "TensorTransportError",
    "TorchShmStatistics",
    "TransportCounters",
    "TransportError",
    "TransportName",
    "TransportStatistics",
    "TypedStub",
    "UnaryMethod",
    "ValidationError",
    "call_context",
    "current_batch",
    "describe",
    "generate_keypair",
    "load_keypair",
    "load_public_key",
    "load_public_keys",
    "release_later",
    "rpc",
    "save_keypair",
    "serve",
    "service",
    "set_release_threshold",
    "share",
    "shared_empty",
    "streaming",
    "unary",
]
