"""`sluice run --config FILE` (flags > environment > file > defaults) and `--log-format json`."""

from __future__ import annotations

import io
import json
import logging

import pytest

from sluice.cli import parse_args
from sluice.cli.logs import setup_logging


def write(tmp_path, text: str) -> str:
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return str(path)


def test_the_file_sets_what_the_command_line_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    config = write(
        tmp_path,
        'max-in-flight = 7\nbootstrap_servers = "kafka:9092"\nno-sessions = true\n'
        'delivery = "exactly-once"\nevent-format = "openai"\nlog-format = "json"\n'
        "drain-timeout = 5\n",
    )
    args = parse_args(["run", "--config", config, "--max-in-flight", "9"])
    assert args.max_in_flight == 9  # the flag wins
    assert args.bootstrap_servers == "kafka:9092" and args.no_sessions is True
    assert args.delivery == "exactly-once" and args.event_format == "openai"
    assert args.log_format == "json" and args.drain_timeout == 5
    assert args.session_ttl == 3600  # neither: the default


def test_the_environment_wins_over_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "from-env:9092")
    args = parse_args(["run", "--config", write(tmp_path, 'bootstrap-servers = "file:9092"\n')])
    assert args.bootstrap_servers is None  # so the environment's value is used, as without a file


@pytest.mark.parametrize(
    "text, says",
    [
        ("max-in-flite = 3\n", "max-in-flite: not a setting of this command; did you mean"),
        ('max-in-flight = "3"\n', "max-in-flight: must be an integer"),
        ("no-sessions = 1\n", "no-sessions: must be true or false"),
        ('delivery = "twice"\n', "delivery: must be one of at-least-once, exactly-once"),
        ("max-in-flight = \n", "not TOML"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_key(tmp_path, capsys, text, says):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["run", "--config", write(tmp_path, text)])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_a_missing_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["run", "--config", str(tmp_path / "none.toml")])
    assert "cannot read it" in capsys.readouterr().err


def test_json_logs_are_one_object_a_line():
    stream = io.StringIO()
    setup_logging("json", stream=stream)
    try:
        log = logging.getLogger("sluice.test")
        log.info("loaded %s", "the model")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("it failed")
    finally:
        setup_logging("text")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "loaded the model" and first["level"] == "INFO"
    assert first["logger"] == "sluice.test" and first["time"].endswith("+00:00")
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]
    assert parse_args(["--log-format", "json", "run"]).log_format == "json"
    assert parse_args(["run", "--log-format", "json"]).log_format == "json"
    assert parse_args(["run"]).log_format == "text"


def test_kafka_security_flags_set_the_variables_every_client_reads(tmp_path, monkeypatch):
    from sluice.cli.kafka_security_flags import export_kafka_security
    from sluice.connectors.kafka_security import KafkaSecurity

    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    for name in ("KAFKA_SECURITY_PROTOCOL", "KAFKA_SASL_MECHANISM", "KAFKA_SSL_CAFILE"):
        monkeypatch.setenv(name, "")  # unset for the test, and put back as it was after it
    monkeypatch.setenv("KAFKA_SASL_USERNAME", "from-env")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "secret")
    config = write(
        tmp_path,
        'security-protocol = "sasl_ssl"\nsasl-mechanism = "SCRAM-SHA-512"\n'
        f'ssl-cafile = "{ca}"\nsasl-username = "from-file"\n',
    )
    args = parse_args(["run", "--config", config, "--sasl-mechanism", "plain"])
    export_kafka_security(args)
    security = KafkaSecurity.from_env()
    assert security.protocol == "SASL_SSL"  # the file's, as the flag would take it
    assert security.sasl_mechanism == "PLAIN"  # the flag wins over the file
    assert security.username == "from-env"  # the environment wins over the file
    assert security.cafile == str(ca)


def test_a_security_protocol_flag_outside_the_choices_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["tail", "--security-protocol", "tls"])
    assert "--security-protocol: invalid choice: 'TLS'" in capsys.readouterr().err
