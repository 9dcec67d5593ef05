"""The bootstrap's ext_proc filter: how Envoy asks policyd, in either of
``EXT_PROC_MODES`` (``envoy_config``'s docstring says why each setting is so).

``forward_rules`` keep the credentials a request or response carries
(``CREDENTIAL_HEADERS``) from policyd in both shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from policyd.extproc.envoy_proto import TYPE_URL
from policyd.extproc.epp import SUBSET_NAMESPACE
from policyd.extproc.replies import LB_METADATA_NAMESPACE
from policyd.policy.flow import MAX_HOLD_SECONDS

if TYPE_CHECKING:
    from policyd.extproc.envoy_config import EnvoyConfigOptions

# The longest policyd may extend one message's timeout (``override_message_timeout``)
# while flow control holds a request: a band's max_wait stays under it.
MAX_MESSAGE_TIMEOUT: Final = f"{MAX_HOLD_SECONDS:g}s"
# Credentials Envoy never sends policyd (ext_proc forward_rules); policyd reads none.
CREDENTIAL_HEADERS: Final = (
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "x-api-key",
)


def forward_rules() -> dict[str, Any]:
    """The ext_proc filter's ``forward_rules``: every header but the credentials."""
    return {"disallowed_headers": {"patterns": [{"exact": name} for name in CREDENTIAL_HEADERS]}}


def ext_proc_filter(options: EnvoyConfigOptions) -> dict[str, Any]:
    """The filter's typed config: policyd's own shape, or an InferencePool's."""
    if options.ext_proc_mode == "inference-pool":
        return _inference_pool_ext_proc(options)
    return {
        "@type": TYPE_URL + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "policyd"}},
        "failure_mode_allow": True,
        "status_on_error": {"code": 503},
        "allow_mode_override": False,
        "message_timeout": options.message_timeout,
        "max_message_timeout": MAX_MESSAGE_TIMEOUT,
        "forward_rules": forward_rules(),
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "request_trailer_mode": "SKIP",
            "response_header_mode": "SEND",
            "response_body_mode": "STREAMED",
            "response_trailer_mode": "SKIP",
        },
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]}},
    }


def _inference_pool_ext_proc(options: EnvoyConfigOptions) -> dict[str, Any]:
    """The filter as Istio generates it for an InferencePool (see ``envoy_config``'s docstring)."""
    return {
        "@type": TYPE_URL + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "policyd"}, "timeout": "10s"},
        "failure_mode_allow": False,
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_header_mode": "SEND",
            "response_body_mode": "FULL_DUPLEX_STREAMED",
            "response_trailer_mode": "SEND",
        },
        "message_timeout": options.message_timeout,
        "max_message_timeout": MAX_MESSAGE_TIMEOUT,
        "forward_rules": forward_rules(),
        "metadata_options": {
            "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
            "forwarding_namespaces": {"untyped": [LB_METADATA_NAMESPACE, SUBSET_NAMESPACE]},
        },
    }
