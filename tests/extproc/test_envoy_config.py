"""``policyd envoy-config``: the bootstrap the real Envoy accepts, with the settings that matter."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from policyd.cli import main
from policyd.extproc.envoy_config import EnvoyConfigOptions, PolicydTls, bootstrap, render
from policyd.extproc.envoy_process import envoy_binary


def envoy_validates(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def ext_proc_of(config: dict[str, Any]) -> dict[str, Any]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = manager["typed_config"]["http_filters"]
    names = [f["name"] for f in filters]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    typed: dict[str, Any] = filters[0]["typed_config"]
    return typed


def cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        c for c in config["static_resources"]["clusters"] if c["name"] == name
    )
    return found


def test_the_printed_config_is_accepted_by_envoy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-config", "--port", "18081", "--policyd-port", "19002"]) == 0
    config = tmp_path / "envoy.yaml"
    config.write_text(capsys.readouterr().out)
    result = envoy_validates(config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_a_config_with_mtls_to_policyd_and_tracing_is_accepted_by_envoy(
    tmp_path: Path, certificates: Any
) -> None:
    config = tmp_path / "envoy.yaml"
    arguments = [
        "envoy-config",
        "--policyd-tls-ca", str(certificates.ca),
        "--policyd-tls-cert", str(certificates.client_cert),
        "--policyd-tls-key", str(certificates.client_key),
        "--policyd-tls-server-name", "policyd",
        "--otlp-endpoint", "127.0.0.1:4317",
        "-o", str(config),
    ]  # fmt: skip
    assert main(arguments) == 0
    result = envoy_validates(config)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_config_asks_envoy_for_what_policyd_needs() -> None:
    config = bootstrap(EnvoyConfigOptions())
    ext_proc = ext_proc_of(config)
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_header_mode": "SEND",
        "response_body_mode": "STREAMED",
        "response_trailer_mode": "SKIP",
    }
    assert ext_proc["failure_mode_allow"] is True  # routing fails closed by its route: below
    assert ext_proc["allow_mode_override"] is False
    assert ext_proc["metadata_options"] == {"receiving_namespaces": {"untyped": ["envoy.lb"]}}
    assert ext_proc["message_timeout"] == "1s"
    pods = cluster(config, "model_servers")
    assert (pods["type"], pods["lb_policy"]) == ("ORIGINAL_DST", "CLUSTER_PROVIDED")
    assert pods["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    listener = config["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 4 * 1024 * 1024
    assert pods["per_connection_buffer_limit_bytes"] == 4 * 1024 * 1024


def test_no_experimental_runtime_guard_is_turned_on() -> None:
    """Envoy 1.40 crashed with ``ext_proc_graceful_grpc_close`` on (issue 23): the
    bootstrap pins it off; policyd ends its streams itself instead
    (tests/e2e/test_stream_close.py). The admin layer Envoy has by default stays."""
    layers = bootstrap(EnvoyConfigOptions())["layered_runtime"]["layers"]
    assert layers[0]["static_layer"] == {
        "envoy.reloadable_features.ext_proc_graceful_grpc_close": False
    }
    assert not [value for value in layers[0]["static_layer"].values() if value is not False]
    assert [layer for layer in layers if "admin_layer" in layer] == [
        {"name": "admin", "admin_layer": {}}
    ]


def test_a_policyd_failure_does_not_cut_a_response_but_nothing_unrouted_reaches_a_pod() -> None:
    """ext_proc fails open (response phases must survive a policyd crash); a request
    policyd did not route has no destination header, the client's is removed as
    the request arrives, and without the header only the JSON 503 route matches."""
    config = bootstrap(EnvoyConfigOptions())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    assert ext_proc_of(config)["failure_mode_allow"] is True
    assert manager["early_header_mutation_extensions"] == [
        {
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation"
                ".header_mutation.v3.HeaderMutation",
                "mutations": [
                    {"remove": "x-gateway-destination-endpoint"},
                    # the prefill pod a P/D sidecar would send a prefill request to
                    {"remove": "x-prefiller-host-port"},
                    # and the client headers that buy priority or pick a flow
                    {"remove": "x-gateway-inference-criticality"},
                    {"remove": "x-llm-d-inference-objective"},
                    {"remove": "x-gateway-inference-objective"},
                    {"remove": "x-llm-d-inference-fairness-id"},
                    {"remove": "x-gateway-inference-fairness-id"},
                    {"remove": "x-request-deadline-ms"},
                    {"remove": "x-tenant"},
                ],
            },
        }
    ]
    to_pod, unrouted = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert to_pod["match"]["headers"] == [
        {"name": "x-gateway-destination-endpoint", "present_match": True}
    ]
    assert unrouted["direct_response"]["status"] == 503


def test_streams_to_policyd_spread_over_connections_and_are_not_capped_at_envoys_default() -> None:
    options = EnvoyConfigOptions(policyd_streams_per_connection=5, policyd_max_streams=7000)
    policyd = cluster(bootstrap(options), "policyd")
    protocol = policyd["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert protocol["explicit_http_config"] == {
        "http2_protocol_options": {"max_concurrent_streams": 5}
    }
    (thresholds,) = policyd["circuit_breakers"]["thresholds"]
    assert thresholds == {
        "max_connections": 7000,
        "max_pending_requests": 7000,
        "max_requests": 7000,
    }
    defaults = cluster(bootstrap(EnvoyConfigOptions()), "policyd")["circuit_breakers"]
    assert defaults["thresholds"][0]["max_requests"] > 1024  # Envoy's own default


def test_the_stream_flags_reach_the_policyd_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--policyd-streams-per-connection", "7", "--policyd-max-streams", "900"]
    assert main(["envoy-config", *flags]) == 0
    policyd = cluster(yaml.safe_load(capsys.readouterr().out), "policyd")
    protocol = policyd["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert protocol["explicit_http_config"]["http2_protocol_options"] == {
        "max_concurrent_streams": 7
    }
    assert policyd["circuit_breakers"]["thresholds"][0]["max_requests"] == 900


def test_long_generations_are_not_cut_by_a_route_timeout() -> None:
    manager = bootstrap(EnvoyConfigOptions(stream_idle_timeout_s=600))["static_resources"][
        "listeners"
    ][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    to_pod = routes[0]
    assert to_pod["match"]["headers"] == [
        {"name": "x-gateway-destination-endpoint", "present_match": True}
    ]
    assert (to_pod["route"]["timeout"], to_pod["route"]["idle_timeout"]) == ("0s", "600s")
    assert manager["stream_idle_timeout"] == "600s"
    assert routes[1]["direct_response"]["status"] == 503  # never to an unnamed destination


def removed_headers(config: dict[str, Any]) -> list[str]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (mutation,) = manager["typed_config"]["early_header_mutation_extensions"]
    return [m["remove"] for m in mutation["typed_config"]["mutations"]]


def test_the_header_flags_add_to_and_keep_from_what_is_removed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["--strip-header", "X-Pool", "--trust-header", "x-tenant"]
    assert main(["envoy-config", *flags, "--request-timeout-s", "200"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert removed_headers(config) == [
        "x-gateway-destination-endpoint",
        "x-prefiller-host-port",
        "x-gateway-inference-criticality",
        "x-llm-d-inference-objective",
        "x-gateway-inference-objective",
        "x-llm-d-inference-fairness-id",
        "x-gateway-inference-fairness-id",
        "x-request-deadline-ms",
        "x-pool",
    ]
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert manager["typed_config"]["request_timeout"] == "200s"
    assert manager["typed_config"]["request_headers_timeout"] == "10s"
    # Trusting every default keeps only the destination's and the prefill pod's removal.
    trust_all = [f"--trust-header={name}" for name in removed_headers(config)[2:8]]
    assert main(["envoy-config", *trust_all, "--trust-header", "x-tenant"]) == 0
    assert removed_headers(yaml.safe_load(capsys.readouterr().out)) == [
        "x-gateway-destination-endpoint",
        "x-prefiller-host-port",
    ]


@pytest.mark.parametrize(
    "flags",
    [
        ["--trust-header", "x-not-removed"],
        ["--trust-header", "x-gateway-destination-endpoint"],
        ["--trust-header", "x-prefiller-host-port"],
        ["--strip-header", "x-gateway-destination-endpoint"],
        ["--strip-header", "bad header"],
        ["--request-timeout-s", "0"],
        ["--request-headers-timeout-s", "-1"],
    ],
)
def test_header_and_timeout_flags_that_make_no_sense_are_refused(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-config", *flags]) == 2
    assert "policyd envoy-config:" in capsys.readouterr().err


def test_plain_text_to_a_policyd_off_this_host_is_warned_about(
    capsys: pytest.CaptureFixture[str], certificates: Any
) -> None:
    assert main(["envoy-config", "--policyd-address", "policyd.ns.svc"]) == 0
    assert "policyd.ns.svc is reached in plain text" in capsys.readouterr().err
    remote = ["--policyd-addresses", "127.0.0.1:9002,10.0.0.7:9002"]
    assert main(["envoy-config", *remote]) == 0
    assert "policyd at 10.0.0.7 is reached in plain text" in capsys.readouterr().err
    assert main(["envoy-config", "--policyd-address", "127.0.0.1"]) == 0
    assert capsys.readouterr().err == ""  # loopback: nothing crosses the network
    tls = ["--policyd-tls-ca", str(certificates.ca)]
    assert main(["envoy-config", "--policyd-address", "policyd.ns.svc", *tls]) == 0
    assert capsys.readouterr().err == ""


def test_credentials_are_never_forwarded_to_policyd_in_either_mode() -> None:
    for mode in ("buffered", "inference-pool"):
        rules = ext_proc_of(bootstrap(EnvoyConfigOptions(ext_proc_mode=mode)))["forward_rules"]
        assert rules == {
            "disallowed_headers": {
                "patterns": [
                    {"exact": name}
                    for name in (
                        "authorization",
                        "proxy-authorization",
                        "cookie",
                        "set-cookie",
                        "x-api-key",
                    )
                ]
            }
        }


def test_policyd_by_dns_name_uses_strict_dns_and_tls_sets_the_server_name() -> None:
    tls = PolicydTls(Path("/ca.pem"), server_name="policyd.ns.svc")
    config = bootstrap(EnvoyConfigOptions(policyd_address="policyd.ns.svc", policyd_tls=tls))
    policyd = cluster(config, "policyd")
    assert policyd["type"] == "STRICT_DNS"
    assert policyd["health_checks"][0]["grpc_health_check"] == {"service_name": "readiness"}
    socket = policyd["transport_socket"]["typed_config"]
    assert socket["sni"] == "policyd.ns.svc"
    assert "tls_certificates" not in socket["common_tls_context"]  # TLS, not mTLS


def test_the_rendered_text_is_the_bootstrap_as_yaml() -> None:
    options = EnvoyConfigOptions(port=1234, buffer_limit_bytes=8 * 1024 * 1024)
    assert yaml.safe_load(render(options)) == bootstrap(options)


@pytest.mark.parametrize(
    "arguments",
    [
        ["--otlp-endpoint", "collector"],
        ["--policyd-tls-cert", "c.pem", "--policyd-tls-key", "k.pem"],
        ["--policyd-tls-ca", "ca.pem", "--policyd-tls-cert", "c.pem"],
        ["--buffer-limit-mib", "0"],
        ["--policyd-streams-per-connection", "0"],
        ["--policyd-max-streams", "-1"],
    ],
)
def test_inconsistent_options_are_refused_with_a_reason(
    arguments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-config", *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("policyd envoy-config: ")


# -- the model servers' cluster and the inference route's retries -------------------------


def chosen_pod_route(config: dict[str, Any]) -> dict[str, Any]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    (route,) = [r["route"] for r in routes if r["name"] == "to_chosen_pod"]
    assert isinstance(route, dict)
    return route


def test_with_original_dst_the_route_never_retries() -> None:
    """ORIGINAL_DST takes one address: a retry could only go to the pod that failed."""
    config = bootstrap(EnvoyConfigOptions(retries=5))
    assert cluster(config, "model_servers")["type"] == "ORIGINAL_DST"
    assert "retry_policy" not in chosen_pod_route(config)


def test_listed_model_servers_get_override_host_and_retries_on_another_pod() -> None:
    config = bootstrap(EnvoyConfigOptions(model_servers=("10.0.0.5:8000", "10.0.0.7:8000")))
    pods = cluster(config, "model_servers")
    assert pods["type"] == "STATIC"
    assert "lb_policy" not in pods and "original_dst_lb_config" not in pods
    (policy,) = pods["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"] == [
        {"header": "x-gateway-destination-endpoint"},
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
    ]
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"].endswith(".least_request")
    (lb_endpoints,) = pods["load_assignment"]["endpoints"]
    assert [e["endpoint"]["address"]["socket_address"] for e in lb_endpoints["lb_endpoints"]] == [
        {"address": "10.0.0.5", "port_value": 8000},
        {"address": "10.0.0.7", "port_value": 8000},
    ]
    (thresholds,) = pods["circuit_breakers"]["thresholds"]
    assert thresholds["max_retries"] > 3 and thresholds["max_requests"] > 1024  # Envoy's defaults
    retry = chosen_pod_route(config)["retry_policy"]
    # Only failures before the request reached a pod: never one a pod died serving.
    assert retry["retry_on"] == "connect-failure,refused-stream,reset-before-request"
    assert retry["num_retries"] == 2
    assert [p["name"] for p in retry["retry_host_predicate"]] == [
        "envoy.retry_host_predicates.previous_hosts"
    ]
    assert "per_try_timeout" not in retry  # generations run for minutes
    assert "retry_policy" not in chosen_pod_route(
        bootstrap(EnvoyConfigOptions(model_servers=("10.0.0.5:8000",), retries=0))
    )


def test_a_model_server_name_resolves_every_address_of_a_headless_service(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["envoy-config", "--model-servers", "vllm.inference.svc.cluster.local:8000"]
    assert main([*arguments, "--retries", "3"]) == 0
    text = capsys.readouterr().out
    config = yaml.safe_load(text)
    assert cluster(config, "model_servers")["type"] == "STRICT_DNS"
    assert chosen_pod_route(config)["retry_policy"]["num_retries"] == 3
    (tmp_path / "envoy.yaml").write_text(text)
    result = envoy_validates(tmp_path / "envoy.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_model_server_flags_reach_the_cluster_and_envoy_accepts_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    addresses = "127.0.0.1:18101, 127.0.0.1:18102"
    assert main(["envoy-config", "--model-servers", addresses]) == 0
    text = capsys.readouterr().out
    pods = cluster(yaml.safe_load(text), "model_servers")
    assert len(pods["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    (tmp_path / "envoy.yaml").write_text(text)
    result = envoy_validates(tmp_path / "envoy.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "arguments",
    [
        ["--model-servers", "10.0.0.5"],
        ["--model-servers", "a.svc:8000,b.svc:8000"],
        ["--model-servers", "10.0.0.5:8000", "--retries", "-1"],
    ],
)
def test_model_server_lists_that_envoy_could_not_use_are_refused(
    arguments: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-config", *arguments]) == 2
    assert capsys.readouterr().err.startswith("policyd envoy-config: ")


# -- several policyd replicas in the one cluster ------------------------------------------


def test_several_policyd_replicas_are_endpoints_of_the_one_cluster_each_health_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    single = cluster(bootstrap(EnvoyConfigOptions()), "policyd")
    assert single["type"] == "STATIC"
    (endpoints,) = single["load_assignment"]["endpoints"]
    assert endpoints["lb_endpoints"] == [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9002}}}}
    ]
    assert main(["envoy-config", "--policyd-addresses", "127.0.0.1:19011, 127.0.0.1:19012"]) == 0
    text = capsys.readouterr().out
    policyd = cluster(yaml.safe_load(text), "policyd")
    assert policyd["type"] == "STATIC"
    (endpoints,) = policyd["load_assignment"]["endpoints"]
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints["lb_endpoints"]
    ]
    assert ports == [19011, 19012]
    assert policyd["health_checks"] == single["health_checks"]  # each host checked on its own
    (tmp_path / "envoy.yaml").write_text(text)
    result = envoy_validates(tmp_path / "envoy.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    names = bootstrap(EnvoyConfigOptions(policyd_addresses=("a.svc:9002", "b.svc:9002")))
    assert cluster(names, "policyd")["type"] == "STRICT_DNS"


@pytest.mark.parametrize("addresses", ["127.0.0.1", "127.0.0.1:9002,:9003", "10.0.0.1:x"])
def test_policyd_address_lists_without_ports_are_refused(
    addresses: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-config", "--policyd-addresses", addresses]) == 2
    assert capsys.readouterr().err.startswith("policyd envoy-config: ")


# -- ports and the numbers Envoy checks only when it loads the bootstrap ------------------


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--port", "70000"], "--port 70000 is not a port (1-65535)"),
        (["--port", "0"], "--port 0 is not a port"),
        (["--policyd-port", "65536"], "--policyd-port 65536 is not a port"),
        (["--admin-port", "-1"], "--admin-port -1 is not a port"),
        (["--model-servers", "10.0.0.5:99999"], "--model-servers 10.0.0.5:99999: 99999"),
        (["--policyd-addresses", "10.0.0.1:0"], "--policyd-addresses 10.0.0.1:0: 0 is not"),
        (["--otlp-endpoint", "collector:123456"], "--otlp-endpoint collector:123456: 123456"),
        (["--otlp-endpoint", ":4317"], "--otlp-endpoint takes host:port addresses"),
        (["--message-timeout-ms", "0"], "--message-timeout-ms must be positive"),
        (["--stream-idle-timeout-s", "-5"], "--stream-idle-timeout-s must be >= 0"),
    ],
)
def test_a_port_or_timeout_envoy_would_refuse_is_refused_with_its_flag(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-config", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"policyd envoy-config: {said}")


def test_envoy_itself_refuses_a_listener_port_past_65535(tmp_path: Path) -> None:
    """Why the check is policyd's: the bootstrap is YAML, and only Envoy's loading says no."""
    (tmp_path / "envoy.yaml").write_text(render(EnvoyConfigOptions(port=70000)))
    result = envoy_validates(tmp_path / "envoy.yaml")
    assert result.returncode != 0
    assert "port_value" in result.stdout + result.stderr
