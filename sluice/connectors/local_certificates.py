"""Self-signed TLS files for the local stack's SASL_SSL broker, made with `openssl` at first start.

A private CA signs the broker's certificate (for 127.0.0.1 and localhost), so clients trust the
CA's file alone (KAFKA_SSL_CAFILE) and the broker presents a certificate that strict verifiers
accept: a CA certificate is not also used as a server's.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CA_DAYS = 3650
BROKER_DAYS = 825  # the longest validity some TLS clients accept for a server certificate

_BROKER_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


class CertificateError(RuntimeError):
    """The certificates could not be made, said with what openssl printed."""


@dataclass(frozen=True)
class LocalCertificates:
    dir: Path

    @property
    def ca_file(self) -> Path:
        """The CA certificate clients trust."""
        return self.dir / "ca.pem"

    @property
    def keystore_file(self) -> Path:
        """The broker's PKCS#8 key, then its certificate and the CA's: a PEM keystore."""
        return self.dir / "broker-keystore.pem"

    def ensure(self) -> LocalCertificates:
        """Make the CA and the broker's certificate unless both are already there."""
        if self.ca_file.exists() and self.keystore_file.exists():
            return self
        openssl = shutil.which("openssl")
        if openssl is None:
            raise CertificateError(
                "`openssl` was not found: it makes the SASL_SSL broker's certificates. Install it "
                "(e.g. `apt-get install openssl`)."
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o700)
        ca_key, key, request = self.dir / "ca.key", self.dir / "broker.key", self.dir / "broker.csr"
        certificate, extensions = self.dir / "broker.pem", self.dir / "broker.ext"
        extensions.write_text(_BROKER_EXTENSIONS)
        ca_subject = "/CN=sluice local stack CA"
        self._run(
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256",
            "-keyout", ca_key, "-out", self.ca_file, "-days", CA_DAYS, "-subj", ca_subject,
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        self._run(
            openssl, "req", "-newkey", "rsa:2048", "-nodes", "-sha256",
            "-keyout", key, "-out", request, "-subj", "/CN=localhost",
        )  # fmt: skip
        self._run(
            openssl, "x509", "-req", "-sha256", "-in", request, "-CA", self.ca_file,
            "-CAkey", ca_key, "-CAcreateserial", "-out", certificate, "-days", BROKER_DAYS,
            "-extfile", extensions,
        )  # fmt: skip
        # `openssl req -nodes` writes PKCS#8 ("BEGIN PRIVATE KEY"), which Kafka's PEM store reads.
        chain = key.read_text() + certificate.read_text() + self.ca_file.read_text()
        self.keystore_file.write_text(chain)
        for path in (ca_key, key, self.keystore_file):
            path.chmod(0o600)
        request.unlink()
        return self

    def _run(self, *command: object) -> None:
        proc = subprocess.run(
            [str(part) for part in command], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise CertificateError(
                f"openssl {command[1]} failed: {(proc.stderr or proc.stdout).strip()[-1000:]}"
            )
