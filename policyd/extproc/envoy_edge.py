"""The bootstrap's edge: the listener, its HTTP connection manager (timeouts,
the client headers removed as a request arrives, tracing, the filters) and its
routes (the chosen pod's, with retries, or a JSON 503 for a request policyd
did not route). ``envoy_config``'s docstring says why each setting is so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from policyd.extproc.envoy_ext_proc import ext_proc_filter
from policyd.extproc.envoy_proto import TYPE_URL, socket_address
from policyd.extproc.replies import DESTINATION_HEADER

if TYPE_CHECKING:
    from policyd.extproc.envoy_config import EnvoyConfigOptions

# What the inference route retries, on another pod (only with the override-host
# cluster): a pod that refused the connection or the stream, or a connection
# reset before the request went out. Never ``reset`` after the request was
# sent: a request that crashes its pod must not be sent to two more.
RETRY_ON: Final = "connect-failure,refused-stream,reset-before-request"
_NO_ROUTE_BODY: Final = (
    '{"error":{"message":"policyd did not route this request",'
    '"type":"service_unavailable","code":"no_destination"}}'
)


def listener(options: EnvoyConfigOptions) -> dict[str, Any]:
    manager: dict[str, Any] = {
        "@type": TYPE_URL
        + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "stream_idle_timeout": f"{options.stream_idle_timeout_s}s",
        "request_timeout": f"{options.request_timeout_s:g}s",
        "request_headers_timeout": f"{options.request_headers_timeout_s:g}s",
        "route_config": _routes(options),
        "early_header_mutation_extensions": [_strip_client_headers(options)],
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc_filter(options)},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": TYPE_URL + "envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    if options.otlp_endpoint:
        manager["tracing"] = {
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": {
                    "@type": TYPE_URL + "envoy.config.trace.v3.OpenTelemetryConfig",
                    "grpc_service": {
                        "envoy_grpc": {"cluster_name": "otlp_collector"},
                        "timeout": "1s",
                    },
                    "service_name": "envoy-inference-gateway",
                },
            }
        }
    return {
        "name": "inference",
        "address": socket_address(options.listen_address, options.port),
        "per_connection_buffer_limit_bytes": options.buffer_limit_bytes,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }


def _routes(options: EnvoyConfigOptions) -> dict[str, Any]:
    return {
        "name": "inference",
        "virtual_hosts": [
            {
                "name": "inference",
                "domains": ["*"],
                "routes": [
                    {
                        "name": "to_chosen_pod",
                        "match": {
                            "prefix": "/",
                            "headers": [{"name": DESTINATION_HEADER, "present_match": True}],
                        },
                        "route": _chosen_pod_route(options),
                    },
                    {
                        "name": "unrouted",
                        "match": {"prefix": "/"},
                        "direct_response": {
                            "status": 503,
                            "body": {"inline_string": _NO_ROUTE_BODY},
                        },
                        # Envoy labels a direct response text/plain.
                        "response_headers_to_add": [
                            {
                                "header": {"key": "content-type", "value": "application/json"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            }
                        ],
                    },
                ],
            }
        ],
    }


def _chosen_pod_route(options: EnvoyConfigOptions) -> dict[str, Any]:
    route: dict[str, Any] = {
        "cluster": "model_servers",
        "timeout": "0s",
        "idle_timeout": f"{options.stream_idle_timeout_s}s",
    }
    if options.model_servers and options.retries > 0:
        route["retry_policy"] = retry_policy(options.retries)
    return route


def retry_policy(retries: int) -> dict[str, Any]:
    """The inference route's retries (what Istio makes of a VirtualService's
    ``retries: {attempts: N, retryOn: RETRY_ON}``): each to a host not tried yet."""
    return {
        "retry_on": RETRY_ON,
        "num_retries": retries,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": TYPE_URL
                    + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }


def _strip_client_headers(options: EnvoyConfigOptions) -> dict[str, Any]:
    """Remove a client's destination header and prefill pod, and the headers that buy
    priority or pick a flow, as the request arrives, before any filter or route sees them
    (an early header mutation of the connection manager).

    policyd removes the destination too, but ext_proc fails open (a policyd
    crash must not cut streaming generations): a request policyd never answered
    must reach the router without the header, which only policyd's reply may
    set. A filter that runs later (authentication setting a header from a
    verified claim) still sets the others.
    """
    removed = (DESTINATION_HEADER, options.prefill_header, *options.stripped_headers)
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": TYPE_URL
            + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": name} for name in removed],
        },
    }
