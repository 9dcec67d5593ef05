"""``policyd serve``'s limit flags reach the server's settings, and bad ones are refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from policyd.cli import main
from policyd.extproc import serve_command as serve

REPO = Path(__file__).resolve().parents[2]
POLICY = str(REPO / "rules" / "default.yaml")


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register("serve", parser)
    return parser.parse_args(["--policy", POLICY, "--pods", "pods.yaml", *flags])


def test_the_defaults_fit_the_deployment() -> None:
    settings = serve.server_options(parse()).settings
    assert settings.max_body_bytes == 16 * 1024 * 1024
    assert settings.max_buffered_body_bytes == 64 * 1024 * 1024
    assert settings.in_flight_expiry_seconds == 330.0
    assert settings.prefill_header == "x-prefiller-host-port"  # llm-d's sidecar reads it


def test_the_prefill_header_and_the_role_label_are_configurable() -> None:
    arguments = parse("--prefill-header", "x-my-prefiller", "--role-label", "example.com/role")
    assert serve.server_options(arguments).settings.prefill_header == "x-my-prefiller"
    assert arguments.role_label == "example.com/role"


def test_the_flags_reach_the_settings() -> None:
    arguments = parse(
        "--max-body-mib", "2", "--max-buffered-body-mib", "8.5", "--in-flight-expiry-seconds", "0"
    )
    settings = serve.server_options(arguments).settings
    assert settings.max_body_bytes == 2 * 1024 * 1024
    assert settings.max_buffered_body_bytes == int(8.5 * 1024 * 1024)
    assert settings.in_flight_expiry_seconds == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-body-mib", "0"], "--max-body-mib must be positive"),
        (["--max-buffered-body-mib", "8"], "--max-buffered-body-mib must be at least"),
        (["--in-flight-expiry-seconds", "-1"], "must not be negative"),
        (["--prefill-header", "X Bad"], "--prefill-header 'X Bad': not a header to use"),
        (["--prefill-header", "x-gateway-destination-endpoint"], "not a header to use"),
    ],
)
def test_bad_limits_are_a_usage_error(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pods = tmp_path / "pods.yaml"
    pods.write_text("pods:\n  - {name: a, address: '127.0.0.1:1'}\n")
    assert main(["serve", "--policy", POLICY, "--pods", str(pods), *flags]) == 2
    assert message in capsys.readouterr().err
