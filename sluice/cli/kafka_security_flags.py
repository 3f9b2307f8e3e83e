"""Kafka TLS and SASL flags, the same on every command that talks to Kafka.

Each flag stands for one KAFKA_* variable of `sluice.connectors.kafka_security`: a flag given
sets its variable for this process, so every client the command starts (and, for `sluice run`,
every actor's) authenticates the same way. A password is better passed in the environment than
as a flag, which other users of the machine can see in the process list.
"""

from __future__ import annotations

import argparse
import os

from sluice.connectors.kafka_security import (
    ENV_SASL_MECHANISM,
    ENV_SASL_PASSWORD,
    ENV_SASL_USERNAME,
    ENV_SECURITY_PROTOCOL,
    ENV_SSL_CAFILE,
    ENV_SSL_CERTFILE,
    ENV_SSL_KEYFILE,
    MECHANISMS,
    PROTOCOLS,
)

# dest -> (flag, variable, metavar, help)
FLAGS = {
    "security_protocol": (
        "--security-protocol",
        ENV_SECURITY_PROTOCOL,
        "PROTOCOL",
        f"{', '.join(PROTOCOLS)} (default PLAINTEXT)",
    ),
    "sasl_mechanism": (
        "--sasl-mechanism",
        ENV_SASL_MECHANISM,
        "MECHANISM",
        f"{', '.join(MECHANISMS)} (default PLAIN)",
    ),
    "sasl_username": ("--sasl-username", ENV_SASL_USERNAME, "USER", "SASL user"),
    "sasl_password": (
        "--sasl-password",
        ENV_SASL_PASSWORD,
        "PASSWORD",
        "SASL password (prefer the variable: flags show in the process list)",
    ),
    "ssl_cafile": ("--ssl-cafile", ENV_SSL_CAFILE, "FILE", "PEM file of the CAs to trust"),
    "ssl_certfile": (
        "--ssl-certfile",
        ENV_SSL_CERTFILE,
        "FILE",
        "PEM client certificate (mutual TLS)",
    ),
    "ssl_keyfile": ("--ssl-keyfile", ENV_SSL_KEYFILE, "FILE", "the client certificate's key"),
}
CHOICES = {"security_protocol": PROTOCOLS, "sasl_mechanism": MECHANISMS}

# For config files: a setting whose variable is set comes from the environment, not the file.
ENVIRONMENT = {dest: variable for dest, (_, variable, _, _) in FLAGS.items()}


def add_kafka_security_arguments(group: argparse._ArgumentGroup) -> None:
    for dest, (flag, variable, metavar, text) in FLAGS.items():
        group.add_argument(
            flag,
            dest=dest,
            default=None,
            metavar=metavar,
            type=str.upper if dest in CHOICES else str,
            choices=CHOICES.get(dest),
            help=f"{text} (env {variable})",
        )


def export_kafka_security(args: argparse.Namespace) -> None:
    """Flags given (or a config file's settings) become this process' KAFKA_* variables."""
    for dest, variable in ENVIRONMENT.items():
        value = getattr(args, dest, None)
        if value is not None:
            os.environ[variable] = str(value)
