"""Self-signed certificates for the manifests' mTLS, without cert-manager:

    python deploy/certs.py DIR && kubectl apply -k DIR

Makes a CA (DIR/ca.crt, DIR/ca.key) and, signed by it, one certificate per role in DIR/ROLE/
(tls.crt, tls.key, ca.crt), and DIR/kustomization.yaml, whose secretGenerator makes the Secrets
the Deployments mount: specbatch-coordinator-tls, specbatch-target-tls, specbatch-draft-tls, of
type kubernetes.io/tls with ca.crt beside tls.crt and tls.key, as cert-manager makes them
(deploy/k8s/components/cert-manager). The namespace must exist: apply an overlay first, or
`kubectl create namespace specbatch`.

- target, draft: server and client authentication (the pod's probe presents it, deploy/README.md),
  for their Service's names: specbatch-target, specbatch-target.NAMESPACE,
  specbatch-target.NAMESPACE.svc, specbatch-target.NAMESPACE.svc.CLUSTER_DOMAIN. The coordinator
  dials each replica by IP and expects the first (the name in its --target=dns:NAME:PORT).
- coordinator: client authentication only.

Run again on the same DIR to renew the three certificates under the same CA. The processes read
their certificates at start: restart the Deployments after. DIR holds private keys (ca.key signs
anything the services would trust): keep it out of git and off shared disks.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("coordinator", "target", "draft")
# The Secret each role's Deployment mounts; deploy/k8s/components/cert-manager makes the same.
SECRETS = {role: f"specbatch-{role}-tls" for role in ROLES}
SERVERS = ("target", "draft")  # the roles that serve mTLS; the coordinator is their client here
CA_DAYS = 3650


def service_names(role: str, namespace: str, cluster_domain: str) -> list[str]:
    """The names a client may dial a role's Service by; the first is what the coordinator checks."""
    name = f"specbatch-{role}"
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{cluster_domain}"]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specbatch"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    # A minute back, so a node whose clock is slightly behind still accepts a fresh certificate.
    return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)


def make_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(_name("specbatch CA")).issuer_name(_name("specbatch CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_now()).not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_leaf(role: str, ca: x509.Certificate, ca_key, namespace: str, cluster_domain: str,
              days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (x509.CertificateBuilder()
               .subject_name(_name(f"specbatch-{role}")).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(_now()).not_valid_after(_now() + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if role in SERVERS:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        names = [x509.DNSName(n) for n in service_names(role, namespace, cluster_domain)]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Created owner-only from the start, never readable for a moment by others.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def kustomization(namespace: str) -> str:
    lines = ["# Made by deploy/certs.py: the Secrets the specbatch Deployments mount. kubectl apply -k .",
             "apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization", f"namespace: {namespace}",
             "generatorOptions:", "  disableNameSuffixHash: true  # the Deployments mount these exact names",
             "secretGenerator:"]
    for role in ROLES:
        lines += [f"  - name: {SECRETS[role]}", "    type: kubernetes.io/tls", "    files:"]
        lines += [f"      - {key}={role}/{key}" for key in ("tls.crt", "tls.key", "ca.crt")]
    return "\n".join(lines) + "\n"


def bootstrap(folder: Path, namespace: str = "specbatch", cluster_domain: str = "cluster.local",
              days: int = 365) -> None:
    ca_crt, ca_pem_key = folder / "ca.crt", folder / "ca.key"
    if ca_crt.exists() and ca_pem_key.exists():  # renewing: keep the CA everything already trusts
        ca = x509.load_pem_x509_certificate(ca_crt.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_pem_key.read_bytes(), password=None)
    else:
        ca, ca_key = make_ca()
        _write(ca_pem_key, _pem_key(ca_key), private=True)
        _write(ca_crt, ca.public_bytes(serialization.Encoding.PEM))
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    for role in ROLES:
        cert, key = make_leaf(role, ca, ca_key, namespace, cluster_domain, days)
        _write(folder / role / "tls.key", _pem_key(key), private=True)
        _write(folder / role / "tls.crt", cert.public_bytes(serialization.Encoding.PEM))
        _write(folder / role / "ca.crt", ca_pem)
    _write(folder / "kustomization.yaml", kustomization(namespace).encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].rstrip(":"))
    parser.add_argument("dir", type=Path, help="where the keys, certificates and kustomization.yaml go")
    parser.add_argument("--namespace", default="specbatch", help="the manifests' namespace (default: specbatch)")
    parser.add_argument("--cluster-domain", default="cluster.local", help="the cluster's DNS domain")
    parser.add_argument("--days", type=int, default=365, help="validity of the three certificates (the CA: 10 years)")
    args = parser.parse_args(argv)
    bootstrap(args.dir, args.namespace, args.cluster_domain, args.days)
    print(f"CA and certificates in {args.dir}. Create the Secrets with:\n\n    kubectl apply -k {args.dir}\n\nor:\n")
    for role in ROLES:
        files = " ".join(f"--from-file={key}={args.dir / role / key}" for key in ("tls.crt", "tls.key", "ca.crt"))
        print(f"    kubectl -n {args.namespace} create secret generic {SECRETS[role]} --type=kubernetes.io/tls {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
