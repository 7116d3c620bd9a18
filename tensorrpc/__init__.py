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
    from tensorrpc._background import set_background_nice
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
    from tensorrpc._compression import Compression
    from tensorrpc._context import CallContext, call_context
    from tensorrpc._exceptions import (
        BroadcastError,
        CallError,
        CallTimeoutError,
        ClosedError,
        ConnectError,
        DecodeError,
        DecompressionError,
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
    from tensorrpc._health import HealthChange, HealthStatus
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
    from tensorrpc.transports._shm_copy import set_copy_threads

__version__ = "0.1.0"

#: Where each public name is defined: module -> the names, separated by spaces.
_MODULES: dict[str, str] = {
    "tensorrpc._batching": "Batching Continuous",
    "tensorrpc._background": "set_background_nice",
    "tensorrpc._blocking": "BlockingCallView BlockingClient BlockingStream BlockingStub",
    "tensorrpc._client": (
        "CallOptions CallStream CallView Client ClientStatistics EngineInfo EngineStatistics"
    ),
    "tensorrpc._codec": "CodecConfig",
    "tensorrpc._compression": "Compression",
    "tensorrpc._context": "CallContext call_context",
    "tensorrpc._exceptions": (
        "BroadcastError CallError CallTimeoutError ClosedError ConnectError DecodeError "
        "DecompressionError DrainingError EncodeError EngineDeadError EngineNotFoundError "
        "EnginesUnavailableError ErrorCode HandshakeRejectedError InvalidArgumentError "
        "LocalProtocolError MetadataError MethodNotFoundError NoCallContextError "
        "OverloadedError PeerUnreachableError PermissionDeniedError ProtocolError "
        "RemoteError RemoteProtocolError SerializationError ServiceDefinitionError "
        "TensorRPCError TensorTransportError TransportError ValidationError"
    ),
    "tensorrpc._health": "HealthChange HealthStatus",
    "tensorrpc._interceptors": "ClientCall ClientInterceptor ServerInterceptor",
    "tensorrpc._observe": "CallObservation Observer",
    "tensorrpc._protocol": "PROTOCOL_VERSION",
    "tensorrpc._release": "release_later set_release_threshold",
    "tensorrpc._security": (
        "CurveClientConfig CurveConfig CurveKeyPair CurveServerConfig generate_keypair "
        "load_keypair load_public_key load_public_keys save_keypair"
    ),
    "tensorrpc._server": "PeerStatistics Server ServerConfig ServerStatistics serve",
    "tensorrpc._service": "BatchSpec MethodSpec ServiceSpec describe rpc service",
    "tensorrpc._stub": "Stub",
    "tensorrpc._typed_stub": "StreamingMethod TypedStub UnaryMethod streaming unary",
    "tensorrpc.transports._shm_copy": "set_copy_threads",
    "tensorrpc._zmq": "SocketOptions",
    "tensorrpc.batching": "BatchContext BatchItem current_batch",
    "tensorrpc.transports": (
        "TorchShmStatistics TransportCounters TransportName TransportStatistics"
    ),
    "tensorrpc.transports._shared": "share shared_empty",
}
_EXPORTS: dict[str, str] = {n: module for module, names in _MODULES.items() for n in names.split()}


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
    "Compression",
    "ConnectError",
    "Continuous",
    "CurveClientConfig",
    "CurveConfig",
    "CurveKeyPair",
    "CurveServerConfig",
    "DecodeError",
    "DecompressionError",
    "DrainingError",
    "EncodeError",
    "EngineDeadError",
    "EngineInfo",
    "EngineNotFoundError",
    "EngineStatistics",
    "EnginesUnavailableError",
    "ErrorCode",
    "HandshakeRejectedError",
    "HealthChange",
    "HealthStatus",
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
    "set_background_nice",
    "set_copy_threads",
    "set_release_threshold",
    "share",
    "shared_empty",
    "streaming",
    "unary",
]
