"""tensorrpc: asyncio-native RPC for tensor-heavy Python services.

Declare a service with ``@service``/``@rpc`` and type hints, run it with [`serve`][tensorrpc.serve]
in
any number of engine processes, and call it through one [`Client`][tensorrpc.Client] that
multiplexes
every engine over a single ZMQ ROUTER socket. Payloads are msgpack (ormsgpack); tensors
travel as zero-copy out-of-band frames or through torch shared memory. Nothing is ever
pickled.
"""

from __future__ import annotations

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
from tensorrpc._service import MethodSpec, ServiceSpec, describe, rpc, service
from tensorrpc._stub import Stub
from tensorrpc._zmq import SocketOptions
from tensorrpc.transports import (
    TorchShmStatistics,
    TransportCounters,
    TransportName,
    TransportStatistics,
)
from tensorrpc.transports._shared import share, shared_empty

__version__ = "0.1.0"

# Tracebacks and reprs name the public path (tensorrpc.ValidationError), not the private
# module an exception is defined in. Only exceptions and ErrorCode: other classes keep
# their module, where typing.get_type_hints() looks up their string annotations.
for _value in list(globals().values()):
    if (
        isinstance(_value, type)
        and issubclass(_value, BaseException | ErrorCode)
        and _value.__module__ == "tensorrpc._exceptions"
    ):
        _value.__module__ = __name__
del _value

__all__ = [
    "PROTOCOL_VERSION",
    "BlockingCallView",
    "BlockingClient",
    "BlockingStream",
    "BlockingStub",
    "BroadcastError",
    "CallError",
    "CallObservation",
    "CallOptions",
    "CallStream",
    "CallTimeoutError",
    "CallView",
    "Client",
    "ClientStatistics",
    "ClosedError",
    "CodecConfig",
    "ConnectError",
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
    "MethodNotFoundError",
    "MethodSpec",
    "Observer",
    "OverloadedError",
    "PeerStatistics",
    "PeerUnreachableError",
    "ProtocolError",
    "RemoteError",
    "RemoteProtocolError",
    "SerializationError",
    "Server",
    "ServerConfig",
    "ServerStatistics",
    "ServiceDefinitionError",
    "ServiceSpec",
    "SocketOptions",
    "Stub",
    "TensorRPCError",
    "TensorTransportError",
    "TorchShmStatistics",
    "TransportCounters",
    "TransportError",
    "TransportName",
    "TransportStatistics",
    "ValidationError",
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
]
