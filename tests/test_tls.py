"""TLS and mTLS on the gRPC servers (specbatch.rpc.tls), with a throwaway CA made by trustme."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import trustme
from tiny import VOCAB

from specbatch.commands import cli
from specbatch.config.options import parser_for
from specbatch.engine.engine import Engine
from specbatch.rpc.server import Server, wait_until_serving
from specbatch.rpc.tls import (
    channel_credentials,
    channel_credentials_from_args,
    open_channel,
    server_credentials,
    server_credentials_from_args,
)
from specbatch.stack.defaults import free_port
from specbatch.v1 import generation_pb2 as gpb
from specbatch.v1 import generation_pb2_grpc as gpb_grpc
from specbatch.v1 import model_services_pb2 as mpb
from specbatch.v1 import model_services_pb2_grpc as mpb_grpc
from target_service.servicer import TargetServicer


class Pki:
    """PEM files of a CA, a server certificate for 127.0.0.1/localhost, a client certificate from
    the same CA, and a client certificate from another CA."""

    def __init__(self, folder: Path):
        self.folder = folder
        ca, other_ca = trustme.CA(), trustme.CA()
        self.ca = self._write("ca.pem", ca.cert_pem)
        self.other_ca = self._write("other-ca.pem", other_ca.cert_pem)
        self.server_cert, self.server_key = self._leaf("server", ca.issue_cert("127.0.0.1", "localhost"))
        self.client_cert, self.client_key = self._leaf("client", ca.issue_cert("client.specbatch.test"))
        self.rogue_cert, self.rogue_key = self._leaf("rogue", other_ca.issue_cert("client.specbatch.test"))

    def _write(self, name: str, blob) -> str:
        path = self.folder / name
        blob.write_to_path(str(path))
        return str(path)

    def _leaf(self, name: str, cert) -> tuple[str, str]:
        chain = self.folder / f"{name}.pem"
        chain.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
        return str(chain), self._write(f"{name}-key.pem", cert.private_key_pem)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def serve_target(target_model, credentials) -> Server:
    server = Server("127.0.0.1:0", max_workers=4, credentials=credentials)
    TargetServicer.serve_on(server, Engine(target_model), "tiny-target")
    return server.start()


@pytest.fixture(scope="module")
def tls_server(pki, target_model):
    server = serve_target(target_model, server_credentials(pki.server_cert, pki.server_key))
    yield f"127.0.0.1:{server.port}"
    server.stop(grace=0)


@pytest.fixture(scope="module")
def mtls_server(pki, target_model):
    server = serve_target(target_model, server_credentials(pki.server_cert, pki.server_key, pki.ca))
    yield f"127.0.0.1:{server.port}"
    server.stop(grace=0)


def cache_stats(address: str, credentials) -> mpb.CacheStatsResponse:
    with open_channel(address, credentials) as channel:
        return mpb_grpc.TargetStub(channel).CacheStats(mpb.CacheStatsRequest(), timeout=10)


def refused(address: str, credentials) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        cache_stats(address, credentials)
    return caught.value


def test_tls_with_the_ca(pki, tls_server):
    stats = cache_stats(tls_server, channel_credentials(pki.ca))
    assert (stats.model, stats.vocab_size) == ("tiny-target", VOCAB)
    wait_until_serving(tls_server, 10, credentials=channel_credentials(pki.ca))


def test_tls_server_refuses_plaintext_and_unknown_ca(pki, tls_server):
    assert refused(tls_server, None).code() == grpc.StatusCode.UNAVAILABLE
    assert refused(tls_server, channel_credentials(pki.other_ca)).code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(TimeoutError):
        wait_until_serving(tls_server, 0.5)  # plaintext health checks never get through


def test_mtls_requires_a_client_certificate_from_the_ca(pki, mtls_server):
    with_cert = channel_credentials(pki.ca, pki.client_cert, pki.client_key)
    assert cache_stats(mtls_server, with_cert).model == "tiny-target"
    assert refused(mtls_server, channel_credentials(pki.ca)).code() == grpc.StatusCode.UNAVAILABLE
    rogue = channel_credentials(pki.ca, pki.rogue_cert, pki.rogue_key)
    assert refused(mtls_server, rogue).code() == grpc.StatusCode.UNAVAILABLE
    assert refused(mtls_server, None).code() == grpc.StatusCode.UNAVAILABLE


# ---- flags ----------------------------------------------------------------------------------------


def parse(program, from_args, argv: list[str]):
    parser = parser_for(program)
    return from_args(parser.parse_args(argv), parser)


def test_server_flags(pki, capsys):
    server = ("target", server_credentials_from_args)
    assert parse(*server, []) is None
    assert isinstance(parse(*server, ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key]),
                      grpc.ServerCredentials)
    assert isinstance(parse(*server, ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                                      "--tls-client-ca", pki.ca]), grpc.ServerCredentials)
    for argv, words in ((["--tls-cert", pki.server_cert], "go together"),
                        (["--tls-key", pki.server_key], "go together"),
                        (["--tls-client-ca", pki.ca], "needs --tls-cert"),
                        (["--tls-cert", pki.server_cert, "--tls-key", "/nonexistent/key.pem"], "cannot read")):
        with pytest.raises(SystemExit) as exit_:
            parse(*server, argv)
        assert exit_.value.code == 2
        assert words in capsys.readouterr().err


def test_client_flags(pki, capsys):
    client = ("coordinator", channel_credentials_from_args)
    assert parse(*client, []) is None
    assert isinstance(parse(*client, ["--service-tls-ca", pki.ca]), grpc.ChannelCredentials)
    assert isinstance(parse(*client, ["--service-tls-ca", pki.ca, "--service-tls-cert", pki.client_cert,
                                      "--service-tls-key", pki.client_key]), grpc.ChannelCredentials)
    for argv, words in ((["--service-tls-ca", pki.ca, "--service-tls-cert", pki.client_cert], "go together"),
                        (["--service-tls-ca", "/nonexistent/ca.pem"], "cannot read")):
        with pytest.raises(SystemExit) as exit_:
            parse(*client, argv)
        assert exit_.value.code == 2
        assert words in capsys.readouterr().err


# ---- the generate command over mTLS -----------------------------------------------------------------


class OneToken(gpb_grpc.GenerationServicer):
    def Generate(self, request, context):
        yield gpb.GenerateResponse(request_id="r", token_ids=[7], text="w2",
                                   finish_reason=gpb.FINISH_REASON_LENGTH, stats=gpb.RequestStats(generated_tokens=1))


def test_generate_command_over_mtls(pki, capsys):
    server = Server("127.0.0.1:0", max_workers=2,
                    credentials=server_credentials(pki.server_cert, pki.server_key, pki.ca))
    server.add(gpb_grpc.add_GenerationServicer_to_server, OneToken(), "specbatch.v1.Generation")
    server.start()
    address = f"127.0.0.1:{server.port}"
    try:
        argv = ["generate", "--token-ids", "1,5", "--max-new-tokens", "1", "--json", "--address", address]
        assert cli.main(argv + ["--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key]) == 0
        assert '"token_ids": [7]' in capsys.readouterr().out
        assert cli.main(argv + ["--tls-ca", pki.ca]) == 1  # no client certificate
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert cli.main(argv + ["--tls-ca", pki.ca, "--tls-cert", pki.client_cert]) == 2
    finally:
        server.stop(grace=0)


# ---- the target service as a process ---------------------------------------------------------------


def test_target_service_process_over_tls(pki, tmp_path, target_model, tokenizer):
    folder = tmp_path / "tiny-target"
    target_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(folder), "--port", str(port),
                                "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                                "--tls-client-ca", pki.ca, "--log-level", "WARNING"])
    address = f"127.0.0.1:{port}"
    credentials = channel_credentials(pki.ca, pki.client_cert, pki.client_key)
    try:
        wait_until_serving(address, 120, credentials=credentials)
        assert cache_stats(address, credentials).vocab_size == VOCAB
        assert refused(address, channel_credentials(pki.ca)).code() == grpc.StatusCode.UNAVAILABLE
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_target_service_refuses_half_tls_flags(pki):
    done = subprocess.run([sys.executable, "-m", "target_service", "--tls-cert", pki.server_cert],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tls-cert and --tls-key go together" in done.stderr


def test_whole_stack_over_mtls(pki, target_model, draft_model, tokenizer):
    """Coordinator → target and draft over mTLS, client → coordinator over TLS: output exact; a
    coordinator without the client certificate is refused by the services at start."""
    from tiny import greedy_reference

    from coordinator.app import build_coordinator
    from draft_service.servicer import DraftServicer
    from specbatch.rpc.client import connect, generate, make_request

    mtls = server_credentials(pki.server_cert, pki.server_key, pki.ca)
    target = serve_target(target_model, mtls)
    draft = Server("127.0.0.1:0", max_workers=4, credentials=mtls)
    DraftServicer.serve_on(draft, Engine(draft_model), "tiny-draft")
    draft.start()
    addresses = (f"127.0.0.1:{target.port}", f"127.0.0.1:{draft.port}")
    coordinator = build_coordinator(*addresses, tokenizer, eos_token_ids=frozenset(),
                                    credentials=channel_credentials(pki.ca, pki.client_cert, pki.client_key),
                                    server_credentials=server_credentials(pki.server_cert, pki.server_key))
    try:
        client = connect(f"127.0.0.1:{coordinator.port}", channel_credentials(pki.ca))
        result = generate(client, make_request([1, 7, 22, 9], 20, k=3, ignore_eos=True), timeout=60)
        assert result.token_ids == greedy_reference(target_model, [1, 7, 22, 9], 20)
        assert result.stats.draft_tokens_proposed > 0
        with pytest.raises(TimeoutError):  # no client certificate: no replica ever becomes healthy
            build_coordinator(*addresses, tokenizer, credentials=channel_credentials(pki.ca), wait_seconds=1.0)
    finally:
        coordinator.stop(grace=0)
        target.stop(grace=0)
        draft.stop(grace=0)


def test_server_name_when_dialling_by_ip(tmp_path, target_model, capsys):
    """A replica found by DNS is dialled by its IP, but its certificate names the service:
    open_channel(server_name=) says which name to expect (--service-tls-server-name)."""
    ca = trustme.CA()
    cert = ca.issue_cert("target.specbatch.test")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "cert.pem").write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    server = serve_target(target_model, server_credentials(tmp_path / "cert.pem", tmp_path / "key.pem"))
    address = f"127.0.0.1:{server.port}"
    credentials = channel_credentials(tmp_path / "ca.pem")
    try:
        assert refused(address, credentials).code() == grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 is not in it
        for name, works in (("target.specbatch.test", True), ("draft.specbatch.test", False)):
            with open_channel(address, credentials, server_name=name) as channel:
                call = lambda: mpb_grpc.TargetStub(channel).CacheStats(mpb.CacheStatsRequest(), timeout=10)  # noqa: E731
                if works:
                    assert call().model == "tiny-target"
                else:
                    with pytest.raises(grpc.RpcError) as caught:
                        call()
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=0)
    with pytest.raises(SystemExit):
        parse("coordinator", channel_credentials_from_args, ["--service-tls-server-name", "x"])
    assert "needs --service-tls-ca" in capsys.readouterr().err


def test_dns_replicas_are_checked_against_the_name_they_were_found_by(tmp_path, target_model, draft_model, tokenizer):
    """``dns:NAME:PORT`` replicas are dialled by IP, which a certificate for a Kubernetes Service
    never names: without --service-tls-server-name the coordinator expects NAME."""
    from coordinator.app import build_coordinator
    from draft_service.servicer import DraftServicer

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    files = {}
    for name, cert in (("server", ca.issue_cert("localhost")), ("client", ca.issue_cert("client.specbatch.test"))):
        (tmp_path / f"{name}.pem").write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(tmp_path / f"{name}-key.pem"))
        files[name] = (tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem")
    mtls = server_credentials(*files["server"], tmp_path / "ca.pem")  # DNS:localhost only, no IP SAN
    target = serve_target(target_model, mtls)
    draft = Server("127.0.0.1:0", max_workers=4, credentials=mtls)
    DraftServicer.serve_on(draft, Engine(draft_model), "tiny-draft")
    draft.start()
    credentials = channel_credentials(tmp_path / "ca.pem", *files["client"])
    addresses = (f"dns:localhost:{target.port}", f"dns:localhost:{draft.port}")
    try:
        coordinator = build_coordinator(*addresses, tokenizer, eos_token_ids=frozenset(), credentials=credentials)
        try:
            assert {r.address for r in coordinator.targets.healthy()} == {f"127.0.0.1:{target.port}"}
        finally:
            coordinator.stop(grace=0)
        with pytest.raises(TimeoutError):  # a name the certificate does not carry overrides it
            build_coordinator(*addresses, tokenizer, credentials=credentials, tls_server_name="other.specbatch.test",
                              wait_seconds=1.0)
    finally:
        target.stop(grace=0)
        draft.stop(grace=0)
