"""The frontend's trust settings: keys from flags and the environment, the cache
salt each key gets, and TLS on both public ports (a certificate made here)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from protos import pb, pb_grpc
from services.frontend.app import is_loopback
from services.frontend.auth import Auth
from services.frontend.config import parse_config
from services.frontend.errors import APIError

from .test_frontend_service import Stack, tiny_model_dir

KEY_A, KEY_B = "key-a-secret", "key-b-secret"


# -- flags ---------------------------------------------------------------------------------


def test_keys_come_from_flags_and_the_environment_and_stay_out_of_repr() -> None:
    config = parse_config(["--decode", "h:1", "--api-key", "sk-one", "--api-key", "sk-two"],
                          env={"SPLITSERVE_API_KEY": " sk-two,sk-three ,"})
    assert config.api_keys == ("sk-one", "sk-two", "sk-three")
    assert "sk-" not in repr(config)
    assert parse_config(["--decode", "h:1"], env={}).api_keys == ()


def test_defaults_bound_every_request() -> None:
    config = parse_config(["--decode", "h:1"], env={})
    assert config.request_timeout_seconds == 600  # a deadline unless the operator says 0
    assert config.max_body_bytes == 4 << 20 and config.max_prompts == 64 and config.max_choices == 256
    assert parse_config(["--decode", "h:1", "--request-timeout", "0"], env={}).request_timeout_seconds == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--cache-isolation", "tenant"], "cache_isolation"),
    (["--tls-cert", "c.pem"], "tls_cert"),
    (["--api-key", "a,b"], "api_key"),
    (["--max-prompts", "0"], "max_prompts"),
])
def test_inconsistent_trust_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(["--decode", "h:1", *argv], env={})


def test_loopback_hosts() -> None:
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "::1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.5", "frontend.internal")))


# -- keys and tenants ----------------------------------------------------------------------


def test_auth_names_a_tenant_per_key_and_refuses_the_rest() -> None:
    auth = Auth([KEY_A, KEY_B])
    a, b = auth.authenticate(f"Bearer {KEY_A}"), auth.authenticate(f"bearer {KEY_B}")
    assert a is not None and b is not None and a.name != b.name
    assert KEY_A not in a.name and a == auth.authenticate(f"Bearer {KEY_A}")
    for bad in (None, "", KEY_A, f"Basic {KEY_A}", f"Bearer {KEY_A} x", "Bearer nope"):
        with pytest.raises(APIError) as e:
            auth.authenticate(bad)
        assert e.value.status == 401 and e.value.grpc_code == grpc.StatusCode.UNAUTHENTICATED
    assert Auth([]).authenticate(None) is None  # no keys: anyone


def test_cache_salts_separate_keys_and_keep_a_key_with_itself() -> None:
    auth = Auth([KEY_A, KEY_B])
    a, b = auth.authenticate(f"Bearer {KEY_A}"), auth.authenticate(f"Bearer {KEY_B}")
    assert a is not None and b is not None
    alone = Auth([KEY_A]).authenticate(f"Bearer {KEY_A}")  # the same key in another frontend
    assert alone is not None and a.cache_salt("") == alone.cache_salt("")
    salts = {a.cache_salt(""), b.cache_salt(""), a.cache_salt("s"), b.cache_salt("s")}
    assert len(salts) == 4 and "s" not in salts and not any(KEY_A in s or KEY_B in s for s in salts)


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model_dir(tmp_path_factory.mktemp("model")), api_keys=(KEY_A, KEY_B),
              cache_isolation="tenant")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.close()


def test_cache_isolation_sends_each_key_its_own_salt(isolated: Stack) -> None:
    def salt(key: str, **extra: str) -> str:
        before = {id(r) for d in isolated.decodes for r in d.requests}
        r = httpx.post(f"{isolated.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"prompt": [1, 2, 3], "max_tokens": 1, **extra}, timeout=10)
        assert r.status_code == 200, r.text
        sent = [r for d in isolated.decodes for r in d.requests if id(r) not in before]
        assert len(sent) == 1
        return str(sent[0].cache_salt)

    a, b = salt(KEY_A), salt(KEY_B)
    assert a != b and a == salt(KEY_A)
    assert salt(KEY_A, cache_salt="mine") not in (a, b, "mine")
    assert salt(KEY_B, cache_salt="mine") != salt(KEY_A, cache_salt="mine")


# -- TLS -----------------------------------------------------------------------------------


def self_signed(directory: Path) -> tuple[str, str]:
    """(certificate, key) files for localhost and 127.0.0.1, valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_tls_on_rest_and_grpc(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    trusted = ssl.create_default_context(cafile=cert)
    stack = Stack(tiny_model_dir(tmp_path), tls_cert=cert, tls_key=key, api_keys=(KEY_A,))
    try:
        stack.wait_healthy(verify=trusted)
        assert stack.url.startswith("https://")
        r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10,
                       headers={"Authorization": f"Bearer {KEY_A}"}, verify=trusted)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"{stack.url}/health", timeout=10)
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{stack.port}/health", timeout=10)

        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=2))
        creds = grpc.ssl_channel_credentials(root_certificates=Path(cert).read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{stack.grpc_port}", creds) as channel:
            msgs = list(pb_grpc.FrontendStub(channel).Generate(
                req, timeout=10, metadata=[("authorization", f"Bearer {KEY_A}")]))
        assert msgs[-1].usage.completion_tokens == 2
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel, \
                pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.FrontendStub(channel).Generate(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS, no call
    finally:
        stack.close()
