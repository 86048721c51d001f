"""Optional TLS and mutual TLS for every gRPC hop: clients → coordinator → draft and target services.

Servers: ``--tls-cert``/``--tls-key`` serve TLS; ``--tls-client-ca`` also requires every client to
present a certificate signed by that CA (mTLS). Without them a server listens in plaintext, as
before (loopback by default).

The coordinator's calls to the services: ``--service-tls-ca`` trusts the services' certificates;
``--service-tls-cert``/``--service-tls-key`` are its own client certificate where the services
require one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc

# Deliberate message limits, on every channel and server: a step for 256 sequences with k=16 is a
# few hundred KB; prompts are capped by the context. 64 MiB leaves room for long re-prefills
# without letting a client send anything unbounded.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def channel_options_reconnecting_within(max_backoff_ms: int) -> list:
    """CHANNEL_OPTIONS with gRPC's reconnect backoff starting at 100 ms and capped at
    ``max_backoff_ms`` (gRPC's own: 1 s, ×1.6 per refused dial, up to 120 s)."""
    return [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", max_backoff_ms)]


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(cert_file: str | Path, key_file: str | Path,
                       client_ca_file: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with ``client_ca_file``, mTLS: clients must present
    a certificate signed by that CA or the handshake fails."""
    return grpc.ssl_server_credentials(
        [(_read(key_file), _read(cert_file))],
        root_certificates=_read(client_ca_file),
        require_client_auth=client_ca_file is not None,
    )


def channel_credentials(ca_file: str | Path | None = None, cert_file: str | Path | None = None,
                        key_file: str | Path | None = None) -> grpc.ChannelCredentials:
    """Trust ``ca_file`` (default: the system roots); ``cert_file``/``key_file`` are the client's
    own certificate, for servers that require one (mTLS)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both its cert file and its key file")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file), private_key=_read(key_file),
                                        certificate_chain=_read(cert_file))


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 options=CHANNEL_OPTIONS, server_name: str | None = None) -> grpc.Channel:
    """A TLS channel with ``credentials``, else a plaintext one; the message limits either way.

    ``server_name``: the name the server's certificate must carry, where it is not the host in
    ``address`` (a replica dialled by its pod IP after DNS discovery, say)."""
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.secure_channel(address, credentials, options=options)


# ---- flags -----------------------------------------------------------------------------------------


def _check_readable(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    if path is None:
        return
    try:
        Path(path).read_bytes()
    except OSError as error:
        parser.error(f"{flag}: cannot read {path}: {error.strerror or error}")


def server_credentials_from_args(args, parser: argparse.ArgumentParser) -> grpc.ServerCredentials | None:
    """The server credentials the TLS flags ask for; None when none is given (plaintext)."""
    cert, key, client_ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if cert is None and key is None:
        if client_ca is not None:
            parser.error("--tls-client-ca needs --tls-cert and --tls-key (mTLS is on top of TLS)")
        return None
    if cert is None or key is None:
        parser.error("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)):
        _check_readable(parser, flag, path)
    try:
        return server_credentials(cert, key, client_ca)
    except Exception as error:  # noqa: BLE001 - grpc raises plain errors on malformed PEM
        parser.error(f"TLS files not usable: {error}")


def channel_credentials_from_args(args, parser: argparse.ArgumentParser) -> grpc.ChannelCredentials | None:
    """Credentials for the coordinator's calls to the services; None when no flag is set
    (plaintext). A client certificate alone also means TLS, trusting the system roots."""
    ca, cert, key = args.service_tls_ca, args.service_tls_cert, args.service_tls_key
    if ca is None and cert is None and key is None:
        if getattr(args, "service_tls_server_name", None):
            parser.error("--service-tls-server-name needs --service-tls-ca (it only applies to TLS)")
        return None
    if (cert is None) != (key is None):
        parser.error("--service-tls-cert and --service-tls-key go together")
    for flag, path in (("--service-tls-ca", ca), ("--service-tls-cert", cert), ("--service-tls-key", key)):
        _check_readable(parser, flag, path)
    return channel_credentials(ca, cert, key)
