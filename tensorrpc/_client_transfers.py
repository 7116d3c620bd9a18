"""The client's tensor transports and size limits with each engine (torch_shm, frames).

`Transfers` answers the protocol's handshake hooks (`ClientHooks`: the torch_shm offer
and proof, whether a peer is reachable) and, per call, where argument tensors go, how
result tensors come back, which leases a dropped reply carries, and whether the encoded
arguments fit the receiver's frame limit.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import anyio

from tensorrpc import _codec
from tensorrpc._compression import ZSTD
from tensorrpc._exceptions import PeerUnreachableError, TensorRPCError
from tensorrpc._hostinfo import host_id as _host_id
from tensorrpc._protocol import Flags, Hello
from tensorrpc._zmq import peer_credentials
from tensorrpc.transports._policy import (
    LazyResolver,
    LeaseCollector,
    PolicyPlacer,
    TransportPolicy,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import Buffer

    from tensorrpc._compression import Compression
    from tensorrpc._engines import Engine
    from tensorrpc._service import MethodSpec
    from tensorrpc._views import CallOptions
    from tensorrpc._zmq import AsyncSocket

__all__ = ["Transfers"]

logger = logging.getLogger("tensorrpc.client")

_SHM_RESULTS_FLAG = int(Flags.SHM_RESULTS)
_COMPRESS_FLAG = int(Flags.COMPRESS)
_SHM_RESULTS_ALL_FLAG = int(Flags.SHM_RESULTS_ALL)


class Transfers:
    """Tensor transports and size limits with each engine (torch_shm, frames)."""

    __slots__ = ("codec_config", "host_id", "maxmsgsize", "policy", "sock")

    def __init__(
        self, policy: TransportPolicy, codec_config: _codec.CodecConfig, maxmsgsize: int
    ) -> None:
        self.policy = policy
        self.codec_config = codec_config
        self.maxmsgsize = maxmsgsize
        self.host_id = _host_id()
        self.sock: AsyncSocket | None = None
        #: With ``engine_keys``: the CURVE key (z85) of the message being handled.

    # -- the protocol's hooks ------------------------------------------------------------

    def shm_offer(
        self, peer: bytes, hello: Hello, frame: Buffer
    ) -> tuple[tuple[str, ...], int, bool, bool] | None:
        """torch_shm only with the process the kernel says sent the HELLO (on ipc://),
        or, configured to trust unattested peers, the one it claims (docs/security.md)."""
        pid, send, receive = self.policy.attest(
            peer,
            peer_credentials(frame),
            offers=hello.transports,
            claimed_pid=hello.pid,
            same_host=hello.host_id == self.host_id,
        )
        if not (send or receive):
            return None
        return (self.policy.offered(), pid, send, receive)

    def reachable(self, peer: bytes, ping: list[bytes]) -> bool:
        """Whether a connection to ``peer`` exists: its ``ping`` can be queued."""
        sock = self.sock
        if sock is None:
            return False
        try:
            sock.send_nowait([peer, *ping])
        except PeerUnreachableError:
            return False
        except (anyio.WouldBlock, TensorRPCError):
            return True
        return True

    # -- per call ------------------------------------------------------------------------

    def placer(self, options: CallOptions, engine: Engine) -> PolicyPlacer | None:
        """Where large argument tensors go (None: frames only)."""
        shm = engine.shm
        return self.policy.placer(
            options.transport, engine.peer, peer_receives=shm is not None and shm.to_engine
        )

    def resolver(self, engine: Engine, frame: object = None) -> LazyResolver | None:
        """Resolves tensors that come back by torch_shm handle (None: torch_shm is off).

        The torch_shm resolver behind it is made on the reply's first handle only.

        Kept after torch_shm *from* the engine was switched off: replies that were already
        in flight may still carry handles, and must fail (or succeed) as transport
        errors, not as undecodable messages.
        """
        # Not attested (or lost), or ``frame`` (a frame of the reply) came on another
        # connection: handles are refused with a TensorTransportError. Result tensors
        # are built on the engine's regions, leased to us until they are freed.
        return self.policy.lazy_resolver(engine.peer, frame=frame, hold=engine.peer)

    def result_flags(self, options: CallOptions, engine: Engine) -> int:
        """The CALL flag bits that tell the engine how to send results: by torch_shm
        (then never compressed), compressed (we decode what we ask for)."""
        mode = options.transport
        shm = engine.shm
        if mode == "frames" or shm is None or not shm.from_engine:
            return _COMPRESS_FLAG if options.compression is not None and shm is None else 0
        return _SHM_RESULTS_ALL_FLAG if mode == "torch_shm" else _SHM_RESULTS_FLAG

    def leases(self, engine: Engine, payload: Buffer, buffers: Sequence[Buffer]) -> list[int]:
        """The torch_shm leases a reply nobody will decode carries (to release)."""
        if engine.shm is None:
            return []  # the engine sends us no handles
        collector = LeaseCollector()
        with contextlib.suppress(TensorRPCError):
            _codec.decode(payload, buffers, self.codec_config, resolver=collector)
        return list(dict.fromkeys(collector.leases))

    def encode(
        self,
        spec: MethodSpec,
        wire: object,
        engine: Engine | None,
        placer: PolicyPlacer | None = None,
        compression: Compression | None = None,
    ) -> _codec.Encoded:
        """Encode arguments and refuse a frame over our ``maxmsgsize`` or the engine's
        (``placer``: released if the arguments are refused). ``compression`` only for an
        engine that decodes zstd and shares no memory with us (another host, or not
        attested): never where torch_shm is in use."""
        if engine is None or engine.shm is not None or ZSTD not in engine.info.compression:
            compression = None
        try:
            encoded = _codec.encode(wire, self.codec_config, placer=placer, compression=compression)
            self.check_sizes(spec, encoded, engine)
        except BaseException:
            if placer is not None:
                placer.abort()
            raise
        return encoded

    def check_sizes(self, spec: MethodSpec, encoded: _codec.Encoded, engine: Engine | None) -> None:
        """A frame over the receiver's MAXMSGSIZE makes its ZMQ drop the whole connection
        without a word, so it is refused here, before sending."""
        _codec.check_message_size(
            encoded,
            self.maxmsgsize,
            0 if engine is None else engine.info.max_message_bytes,
            what=f"{spec.qualname}: the arguments",
            peer="engine" if engine is None else f"engine {engine.engine_id!r}",
        )
