"""tensorrpc: asyncio-native RPC for tensor-heavy Python services.

Declare a service with ``@service``/``@rpc`` and type hints, run it with :func:`serve` in
any number of engine processes, and call it through one :class:`Client` that multiplexes
every engine over a single ZMQ ROUTER socket. Payloads are msgpack (ormsgpack); tensors
travel as zero-copy out-of-band frames or through torch shared memory. Nothing is ever
pickled.
"""

from __future__ import annotations

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
    MethodNotFoundError,
    OverloadedError,
    PeerUnreachableError,
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
from tensorrpc._protocol import PROTOCOL_VERSION
from tensorrpc._server import PeerStatistics, Server, ServerStatistics, serve
from tensorrpc._service import MethodSpec, ServiceSpec, describe, rpc, service

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "BroadcastError",
    "CallError",
    "CallOptions",
    "CallStream",
    "CallTimeoutError",
    "CallView",
    "Client",
    "ClientStatistics",
    "ClosedError",
    "CodecConfig",
    "ConnectError",
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
    "MethodNotFoundError",
    "MethodSpec",
    "OverloadedError",
    "PeerStatistics",
    "PeerUnreachableError",
    "ProtocolError",
    "RemoteError",
    "RemoteProtocolError",
    "SerializationError",
    "Server",
    "ServerStatistics",
    "ServiceDefinitionError",
    "ServiceSpec",
    "TensorRPCError",
    "TensorTransportError",
    "TransportError",
    "ValidationError",
    "describe",
    "rpc",
    "serve",
    "service",
]
