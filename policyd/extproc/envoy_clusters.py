"""The bootstrap's clusters: policyd's (gRPC, health-checked, optionally over
TLS, several replicas) and the model servers' (ORIGINAL_DST on the destination
header, or the listed pods behind Envoy's override-host load balancing).
``envoy_config``'s docstring says why each setting is so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from policyd.extproc.envoy_proto import TYPE_URL, is_ip, socket_address
from policyd.extproc.health import READINESS
from policyd.extproc.replies import DESTINATION_HEADER, LB_METADATA_NAMESPACE

if TYPE_CHECKING:
    from policyd.extproc.envoy_config import EnvoyConfigOptions


def grpc_cluster(name: str, host: str, port: int, connect_timeout: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC" if is_ip(host) else "STRICT_DNS",
        "connect_timeout": connect_timeout,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": TYPE_URL + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": socket_address(host, port)}}]}
            ],
        },
    }


def policyd_cluster(options: EnvoyConfigOptions) -> dict[str, Any]:
    cluster = grpc_cluster("policyd", options.policyd_address, options.policyd_port, "1s")
    if options.policyd_addresses:
        hosts = [address.rpartition(":") for address in options.policyd_addresses]
        cluster["type"] = "STATIC" if all(is_ip(host) for host, _, _ in hosts) else "STRICT_DNS"
        cluster["load_assignment"]["endpoints"] = [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": socket_address(host, int(port))}}
                    for host, _, port in hosts
                ]
            }
        ]
    protocol = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    protocol["explicit_http_config"]["http2_protocol_options"] = {
        "max_concurrent_streams": options.policyd_streams_per_connection
    }
    limit = options.policyd_max_streams
    cluster["circuit_breakers"] = {
        "thresholds": [
            {"max_connections": limit, "max_pending_requests": limit, "max_requests": limit}
        ]
    }
    cluster["health_checks"] = [
        {
            "timeout": "1s",
            "interval": "2s",
            # Also before the cluster's first request (Envoy's default there is
            # 60 s): a replica not ready at Envoy's start would stay out a minute.
            "no_traffic_interval": "2s",
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": READINESS},
        }
    ]
    tls = options.policyd_tls
    if tls is not None:
        context: dict[str, Any] = {
            "@type": TYPE_URL + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "validation_context": {"trusted_ca": {"filename": str(tls.ca)}},
            },
        }
        if tls.cert is not None and tls.key is not None:
            context["common_tls_context"]["tls_certificates"] = [
                {
                    "certificate_chain": {"filename": str(tls.cert)},
                    "private_key": {"filename": str(tls.key)},
                }
            ]
        if tls.server_name:
            context["sni"] = tls.server_name
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": context,
        }
    return cluster


def model_cluster(options: EnvoyConfigOptions) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": "model_servers",
        "connect_timeout": f"{options.upstream_connect_timeout_s:g}s",
        "per_connection_buffer_limit_bytes": options.buffer_limit_bytes,
    }
    if not options.model_servers:
        return {
            **cluster,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            },
        }
    addresses = [address.rpartition(":") for address in options.model_servers]
    endpoints = [
        {"endpoint": {"address": socket_address(host, int(port))}} for host, _, port in addresses
    ]
    # Every request in flight holds an upstream request, and each retry a retry:
    # Envoy's defaults (1024 and 3) would fail the 1025th generation and the
    # fourth concurrent retry.
    limit = options.policyd_max_streams
    return {
        **cluster,
        "type": "STATIC" if all(is_ip(host) for host, _, _ in addresses) else "STRICT_DNS",
        "load_balancing_policy": override_host_policy(),
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": limit,
                    "max_pending_requests": limit,
                    "max_requests": limit,
                    "max_retries": limit,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": "model_servers",
            "endpoints": [{"lb_endpoints": endpoints}],
        },
    }


def override_host_policy() -> dict[str, Any]:
    """Envoy's override-host load balancing: the addresses policyd named, in order
    (one per attempt; an address not among the cluster's endpoints is skipped),
    then the endpoint with the fewest active requests."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": TYPE_URL + "envoy.extensions.load_balancing_policies.override_host"
                        ".v3.OverrideHost",
                        "override_host_sources": [
                            {"header": DESTINATION_HEADER},
                            {
                                "metadata": {
                                    "key": LB_METADATA_NAMESPACE,
                                    "path": [{"key": DESTINATION_HEADER}],
                                }
                            },
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.least_request",
                                        "typed_config": {
                                            "@type": TYPE_URL
                                            + "envoy.extensions.load_balancing_policies"
                                            ".least_request.v3.LeastRequest"
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }
