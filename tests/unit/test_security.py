"""CURVE keys, key files, ZAP decisions and endpoint rules, without sockets.

The same on real ZMQ sockets (handshakes, the wire, the bind warning):
tests/integration/test_security_sockets.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

from tensorrpc._security import (
    AuthStatistics,
    CurveClientConfig,
    CurveKeyPair,
    CurveServerConfig,
    ZapAuthenticator,
    generate_keypair,
    is_all_interfaces,
    is_loopback,
    load_keypair,
    load_public_key,
    load_public_keys,
    save_keypair,
)

# -- ZAP decisions, without sockets ----------------------------------------------------------


def test_zap_decisions_fail_closed():
    client, stranger = generate_keypair(), generate_keypair()
    auth = ZapAuthenticator(zmq.Context.instance())  # not started: decisions only
    listed = auth.register([client.public_key])
    anyone = auth.register(None)

    def ask(domain: str, mechanism: bytes, *credentials: bytes) -> tuple[bytes, bytes]:
        request = [b"1.0", b"7", domain.encode(), b"127.0.0.1", b"", mechanism, *credentials]
        reply = auth._safe_answer(request)
        assert reply[:2] == [b"1.0", b"7"]
        return reply[2], reply[4]

    raw = z85.decode(client.public_key)
    assert ask(listed, b"CURVE", raw) == (b"200", client.public_key)
    assert ask(listed, b"CURVE", z85.decode(stranger.public_key)) == (b"400", b"")
    assert ask(anyone, b"CURVE", z85.decode(stranger.public_key))[0] == b"200"
    assert ask("not-ours", b"CURVE", raw)[0] == b"400"
    assert ask("", b"CURVE", raw)[0] == b"400"
    assert ask(listed, b"PLAIN", b"user", b"password")[0] == b"400"
    assert ask(listed, b"CURVE")[0] == b"400"
    assert ask(listed, b"NULL")[0] == b"200"
    assert auth._safe_answer([b"0.9", b"8", b"d", b"a", b"", b"CURVE", raw])[2] == b"400"
    assert auth._safe_answer([b"1.0"])[2] == b"400"
    assert auth.statistics(listed) == AuthStatistics(accepted=1, denied=3)
    assert auth.statistics(anyone) == AuthStatistics(accepted=1, denied=0)
    auth.unregister(listed)
    assert ask(listed, b"CURVE", raw)[0] == b"400"


# -- keys and key files ----------------------------------------------------------------------


def test_generated_keypairs_are_z85_and_distinct():
    one, two = generate_keypair(), generate_keypair()
    assert len(one.public_key) == len(one.secret_key) == 40
    assert one.public_key != two.public_key
    assert zmq.curve_public(one.secret_key) == one.public_key


def test_keypair_repr_never_shows_the_secret_key():
    keys = generate_keypair()
    assert keys.secret_key.decode() not in repr(keys)
    assert keys.public_key.decode() in repr(keys)


def test_keypair_rejects_mismatched_or_malformed_keys():
    one, two = generate_keypair(), generate_keypair()
    with pytest.raises(ValueError, match="does not belong"):
        CurveKeyPair(one.public_key, two.secret_key)
    with pytest.raises(ValueError, match="40 z85 characters"):
        CurveKeyPair(one.public_key[:-1], one.secret_key)
    with pytest.raises(TypeError, match="z85-encoded bytes"):
        CurveKeyPair(one.public_key.decode(), one.secret_key)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not valid z85"):
        CurveClientConfig(one, b'"' * 40)


def test_server_config_normalises_and_checks_the_allow_list():
    keys, client = generate_keypair(), generate_keypair()
    config = CurveServerConfig(keys, [client.public_key, client.public_key])
    assert config.allowed_clients == frozenset({client.public_key})
    with pytest.raises(TypeError, match="not one key"):
        CurveServerConfig(keys, client.public_key)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed client key"):
        CurveServerConfig(keys, [b"short"])


def test_saved_keypair_loads_back_and_the_secret_file_is_private(tmp_path: Path):
    keys = generate_keypair()
    public_path, secret_path = save_keypair(keys, tmp_path, "engine")
    assert public_path == tmp_path / "engine.key"
    assert secret_path == tmp_path / "engine.key_secret"
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    assert keys.secret_key not in public_path.read_bytes()
    assert load_keypair(secret_path) == keys
    assert load_public_key(public_path) == keys.public_key
    assert load_public_key(secret_path) == keys.public_key
    # The files are ZMQ certificates.
    assert zmq.auth.load_certificate(secret_path) == (keys.public_key, keys.secret_key)
    assert zmq.auth.load_certificate(public_path) == (keys.public_key, None)


def test_secret_file_is_private_whatever_the_umask(tmp_path: Path):
    old = os.umask(0)
    try:
        _, secret_path = save_keypair(generate_keypair(), tmp_path, "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600


def test_saving_never_overwrites_unless_asked(tmp_path: Path):
    first, second = generate_keypair(), generate_keypair()
    save_keypair(first, tmp_path, "k")
    with pytest.raises(FileExistsError):
        save_keypair(second, tmp_path, "k")
    assert load_keypair(tmp_path / "k.key_secret") == first
    save_keypair(second, tmp_path, "k", overwrite=True)
    assert load_keypair(tmp_path / "k.key_secret") == second
    with pytest.raises(ValueError, match="invalid key file name"):
        save_keypair(first, tmp_path, "../k")


def test_loading_refuses_a_secret_file_others_can_read(tmp_path: Path):
    _, secret_path = save_keypair(generate_keypair(), tmp_path, "k")
    secret_path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_keypair(secret_path)
    assert load_keypair(secret_path, check_permissions=False).public_key


def test_a_public_certificate_is_not_a_keypair(tmp_path: Path):
    public_path, _ = save_keypair(generate_keypair(), tmp_path, "k")
    with pytest.raises(ValueError, match="holds no secret key"):
        load_keypair(public_path, check_permissions=False)


def test_allow_list_loads_from_a_directory_of_public_certificates(tmp_path: Path):
    clients = [generate_keypair() for _ in range(3)]
    (tmp_path / "allowed").mkdir()
    for i, keys in enumerate(clients):
        public_path, _ = save_keypair(keys, tmp_path, f"client-{i}")
        public_path.rename(tmp_path / "allowed" / public_path.name)
    assert load_public_keys(tmp_path / "allowed") == {k.public_key for k in clients}
    assert load_public_keys(tmp_path) == frozenset()  # secret certificates are not read


# -- the all-interfaces warning --------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "exposed"),
    [
        ("tcp://*:5555", True),
        ("tcp://*:*", True),
        ("tcp://0.0.0.0:5555", True),
        ("tcp://0.0.0.0:0", True),
        ("tcp://[::]:5555", True),
        ("tcp://[0:0:0:0:0:0:0:0]:5555", True),
        ("tcp://:::5555", True),
        ("TCP://*:1", True),
        ("ws://*:8080/path", True),
        ("tcp://127.0.0.1:5555", False),
        ("tcp://127.0.0.1:0", False),
        ("tcp://[::1]:5555", False),
        ("tcp://192.168.1.10:5555", False),
        ("tcp://lo:5555", False),
        ("tcp://localhost:5555", False),
        ("ipc:///tmp/sock", False),
        ("inproc://*", False),
        ("garbage", False),
    ],
)
def test_all_interfaces_endpoints_are_recognised(endpoint: str, exposed: bool):
    assert is_all_interfaces(endpoint) is exposed


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.2:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://lo:5555", True),
        ("ipc:///tmp/sock", True),
        ("inproc://x", True),
        ("tcp://192.168.1.10:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://host.example:5555", False),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
    ],
)
def test_loopback_endpoints_are_recognised(endpoint: str, loopback: bool):
    assert is_loopback(endpoint) is loopback
