"""A stable identifier for this host and boot, used to detect peers on the same host.

Two processes see the same `host_id` when they run on the same machine, in the
same boot, under the same hostname (and the same ``/etc/machine-id``). Containers on one
machine usually differ in hostname and machine id, so they are (conservatively) treated
as different hosts: their ``/dev/shm`` is not necessarily shared either.
"""

from __future__ import annotations

import functools
import hashlib
import socket

__all__ = ["host_id"]

_SOURCES = (
    "/etc/machine-id",
    "/var/lib/dbus/machine-id",
    "/proc/sys/kernel/random/boot_id",
)
_MAX_HOSTNAME = 200


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return ""


@functools.cache
def host_id() -> str:
    """Return ``"<hostname>/<digest>"``, stable for this host until it reboots.

    The digest hashes the hostname, the machine id and the kernel's boot id (whichever
    of them exist), so a reboot or another machine with the same hostname gives another
    value.
    """
    hostname = socket.gethostname()[:_MAX_HOSTNAME]
    digest = hashlib.sha256()
    digest.update(hostname.encode("utf-8", "replace"))
    for path in _SOURCES:
        digest.update(b"\0")
        digest.update(_read(path).encode("ascii", "replace"))
    return f"{hostname}/{digest.hexdigest()[:24]}"
