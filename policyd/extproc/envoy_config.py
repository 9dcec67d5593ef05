"""``policyd envoy-config``: an Envoy bootstrap that puts policyd in the request path.

    policyd envoy-config --port 8081 --policyd-port 9002 > envoy.yaml
    envoy -c envoy.yaml --disable-hot-restart   # as envoy_process.py runs it

What it sets up, and why:

- ext_proc filter -> cluster ``policyd`` (HTTP/2, gRPC health-checked on the
  ``readiness`` service). Request headers SEND, request body BUFFERED (the
  destination header can only be set from a body reply in BUFFERED mode),
  response headers SEND, response body STREAMED (policyd acknowledges every
  chunk at once and reads ``usage`` on the side, so tokens still reach the
  client as they are generated; BUFFERED would hold a whole stream back).
  ``failure_mode_allow: true``: when policyd fails (crash, restart, timeout)
  Envoy carries on without it, so a generation already streaming is not cut.
  Routing stays fail-closed all the same: only policyd's routing reply sets
  the destination header, an early header mutation of the connection manager
  removes any copy the client sent before a filter or route sees it, and a
  request without the header matches only the ``unrouted`` route (a 503).
  ``allow_mode_override: false``: the server cannot widen what Envoy sends.
  ``metadata_options.receiving_namespaces.untyped: [envoy.lb]`` accepts the
  destination in dynamic metadata.
- at most ``policyd_streams_per_connection`` streams share a connection to
  policyd: Envoy otherwise multiplexes every stream of a worker thread on one
  connection, and ``policyd serve --workers N`` can only spread connections
  (SO_REUSEPORT), so one worker would do all the work. Circuit breakers sized
  for one stream per in-flight request (``policyd_max_streams``): Envoy's
  default of 1024 would turn the 1025th concurrent generation into a 503.
- cluster ``model_servers``: ORIGINAL_DST keyed on
  ``x-gateway-destination-endpoint``; a route only sends there when the header
  is present (policyd always sets it), anything else gets a JSON 503 instead of
  Envoy's fallback to the downstream connection's own destination. ORIGINAL_DST
  takes exactly one address, so the route does not retry: a retry would go to
  the same pod. With ``model_servers`` listed (``--model-servers``) the cluster
  holds those endpoints and picks with Envoy's override-host policy instead:
  the first address of the header (or ``envoy.lb`` metadata) policyd set, and on
  each retry the next one (``policyd serve --send-fallbacks``), then, past the
  list, the pod with the fewest requests other than those tried. The route then
  retries a request whose pod refused the connection or the stream, or reset
  it before the request was sent (``RETRY_ON``), up to ``retries`` times: a
  killed pod costs the requests it was serving, not those sent to it before
  policyd noticed.
- per-connection buffer limit (default 4 MiB) on the listener and the model
  cluster: it caps a BUFFERED request body (Envoy answers 413 past it), so it
  must fit real prompts.
- no route timeout and a 5-minute stream idle timeout: generations can run for
  minutes, and queue for a while before the first token.
- a request timeout (``request_timeout``, default 300 s) and a request headers
  timeout (``request_headers_timeout``, default 10 s) in the connection
  manager: a client that sends headers and never the body (or sends it a byte
  at a time) holds a buffer and a policyd stream only that long, then gets a
  408. Envoy's request timeout covers the receipt of the request, not the
  response: it ends when the last byte of the request has passed every filter
  (for a request flow control holds, when policyd lets it go) or when the
  response starts, so it must exceed ``max_message_timeout`` (a hold) plus the
  time to upload the largest body; it never cuts a generation.
- a client's ``x-prefiller-host-port`` (``prefill_header``), which would make
  the decode pod's P/D sidecar send a prefill request to any host it names,
  is always removed as the request arrives, as the destination header is;
  only policyd's routing reply sets it, for a split request.
- the client headers that buy priority or pick a flow (``stripped_headers``:
  by default the criticality, objective, fairness id, deadline and
  ``x-tenant`` headers) are removed
  with the destination header as the request arrives, so only a filter after
  that point (an authentication filter setting them from a verified token) or,
  when the operator keeps them, a trusted proxy in front can set them
  (docs/serving.md, "Trust model").
- ext_proc ``forward_rules`` never show policyd the credentials a request or
  response carries (``CREDENTIAL_HEADERS``): policyd reads none of them, and
  the model server still gets them.
- ``max_message_timeout`` of 120 s: how far policyd may extend its wait for
  one reply while flow control holds a request (``override_message_timeout``;
  a band's ``max_wait`` is under it).
- the experimental runtime guard
  ``envoy.reloadable_features.ext_proc_graceful_grpc_close`` pinned off (its
  default): with it on, Envoy 1.40 crashed (segmentation fault in the ext_proc
  stream's close) under long generations ending together. Envoy then resets
  each ext_proc stream as it ends; policyd ends the stream itself first
  (``process_stream.py``), so the reset has nothing to cancel (grpcio leaks a batch
  a reset makes fail, grpc/grpc#43360; ``benchmarks/leak_soak.py``). The
  admin runtime layer, which Envoy has by default, stays.
- the admin interface on loopback only.

``--ext-proc-mode inference-pool`` shapes the ext_proc filter the way Istio
generates it for an InferencePool's endpoint picker
(``BuildInferencePoolExtProcFilter`` in istio/istio
``pilot/pkg/xds/filters/filters.go``), so policyd runs as gateways call it:
request and response bodies FULL_DUPLEX_STREAMED with both trailer modes
SEND (Envoy requires SEND with that body mode), headers SEND, a 1000 s message
timeout (the routing reply waits for the whole request body), a 10 s gRPC
timeout, ``failure_mode_allow`` off (the pool's default ``failureMode:
FailClose``: every response chunk passes through the picker, so there is
nothing to fail open to), no ``allow_mode_override``, and ``envoy.lb`` as
both receiving and forwarding metadata namespace. policyd adds
``envoy.lb.subset_hint`` to the forwarded namespaces, where the protocol puts
a proxy's endpoint subset (``docs/endpoint-picker.md``), and the
``forward_rules`` that keep credentials from policyd (Istio's filter has none). The rest of the
bootstrap (listener, ORIGINAL_DST cluster on the destination header, which is
what kgateway and Envoy AI Gateway generate for a pool) is the same.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from policyd.extproc.envoy_clusters import grpc_cluster, model_cluster, policyd_cluster
from policyd.extproc.envoy_edge import listener
from policyd.extproc.envoy_proto import TYPE_URL, is_ip, socket_address
from policyd.extproc.replies import DESTINATION_HEADER, PREFILL_HEADER, is_header_name
from policyd.policy.client_headers import FAIRNESS_HEADERS, OBJECTIVE_HEADERS
from policyd.policy.document import DEFAULT_CRITICALITY_HEADER
from policyd.policy.flow import DEFAULT_DEADLINE_HEADER

MIB: Final = 1024 * 1024
GRACEFUL_CLOSE_FLAG: Final = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
# Envoy runtime flags the bootstrap sets (see the module docstring): the
# experimental graceful close stays off, even where a mesh-wide default turns it on.
RUNTIME_FLAGS: Final = {GRACEFUL_CLOSE_FLAG: False}
# The ext_proc filter's shapes: policyd's own (BUFFERED request body, STREAMED
# response body) and Istio's for an InferencePool (see the module docstring).
EXT_PROC_MODES: Final = ("buffered", "inference-pool")
# Envoy's wait for each policyd reply, by mode when not given: Istio's is 1000 s.
DEFAULT_MESSAGE_TIMEOUT_MS: Final = {"buffered": 1000, "inference-pool": 1_000_000}
# Envoy's limits on receiving a request (see the module docstring): the whole
# request well beyond a hold, the headers in seconds.
DEFAULT_REQUEST_TIMEOUT_S: Final = 300.0
DEFAULT_REQUEST_HEADERS_TIMEOUT_S: Final = 10.0
# The flow key header the documentation's policies use (``flows.key``).
TENANT_HEADER: Final = "x-tenant"
# Client headers a policy honours for priority, deadline or flow: removed as the
# request arrives unless the operator trusts what sets them (docs/serving.md,
# "Trust model").
PRIORITY_HEADERS: Final = (
    DEFAULT_CRITICALITY_HEADER,
    *OBJECTIVE_HEADERS,
    *FAIRNESS_HEADERS,
    DEFAULT_DEADLINE_HEADER,
    TENANT_HEADER,
)


@dataclass(frozen=True, slots=True)
class PolicydTls:
    """How Envoy connects to policyd over TLS (``cert``/``key``: mTLS client identity)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    server_name: str = ""


@dataclass(frozen=True, slots=True)
class EnvoyConfigOptions:
    listen_address: str = "127.0.0.1"
    port: int = 8081
    policyd_address: str = "127.0.0.1"
    policyd_port: int = 9002
    admin_port: int = 9901
    buffer_limit_bytes: int = 4 * MIB
    # None: the mode's default (DEFAULT_MESSAGE_TIMEOUT_MS).
    message_timeout_ms: int | None = None
    stream_idle_timeout_s: int = 300
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    request_headers_timeout_s: float = DEFAULT_REQUEST_HEADERS_TIMEOUT_S
    # Client headers removed as the request arrives; () keeps them all, for a
    # gateway behind a trusted proxy that sets them.
    stripped_headers: tuple[str, ...] = PRIORITY_HEADERS
    upstream_connect_timeout_s: float = 5.0
    max_connections: int = 50_000
    # Streams Envoy multiplexes on one connection to policyd before it opens
    # another: what lets `policyd serve --workers N` share the load (see
    # envoy_clusters.policyd_cluster).
    policyd_streams_per_connection: int = 32
    # Concurrent ext_proc streams (one per in-flight request) Envoy allows to
    # policyd before its circuit breaker answers 503.
    policyd_max_streams: int = 50_000
    policyd_tls: PolicydTls | None = None
    # Several policyd replicas as ``host:port`` endpoints of the one cluster (all
    # IPs: STATIC, else STRICT_DNS), each health-checked on its own; Envoy spreads
    # streams over the healthy ones. Empty: policyd_address and policyd_port.
    policyd_addresses: tuple[str, ...] = ()
    # The model servers as ``ip:port`` (a STATIC cluster) or one ``name:port``
    # (STRICT_DNS, e.g. a headless Service). Empty: ORIGINAL_DST on the
    # destination header, one address per request and no retries.
    model_servers: tuple[str, ...] = ()
    # Retries of a request whose pod failed it before it was sent, each to the
    # next address policyd named, then another pod; only with model_servers.
    retries: int = 2
    # host:port of an OTLP/gRPC collector: Envoy then traces every request and
    # passes its traceparent to policyd and the model server.
    otlp_endpoint: str = ""
    # One of EXT_PROC_MODES.
    ext_proc_mode: str = "buffered"
    # Where policyd names a split request's prefill pod (policyd serve
    # --prefill-header): always removed as the request arrives, as the destination is.
    prefill_header: str = PREFILL_HEADER

    def __post_init__(self) -> None:
        if self.ext_proc_mode not in EXT_PROC_MODES:
            raise ValueError(f"ext_proc_mode must be one of {', '.join(EXT_PROC_MODES)}")
        if self.request_timeout_s <= 0 or self.request_headers_timeout_s <= 0:
            raise ValueError("the request and request headers timeouts must be positive")
        for name in self.stripped_headers:
            if not is_header_name(name):
                raise ValueError(f"{name!r} is not a lower-case HTTP header name")
        if DESTINATION_HEADER in self.stripped_headers:
            raise ValueError(f"{DESTINATION_HEADER} is always removed")
        if not is_header_name(self.prefill_header) or self.prefill_header == DESTINATION_HEADER:
            raise ValueError(f"{self.prefill_header!r} cannot name the prefill pod")

    @property
    def message_timeout(self) -> str:
        """Envoy's wait for each policyd reply, as a protobuf Duration string."""
        milliseconds = self.message_timeout_ms
        if milliseconds is None:
            milliseconds = DEFAULT_MESSAGE_TIMEOUT_MS[self.ext_proc_mode]
        return f"{milliseconds / 1000:g}s"


def bootstrap(options: EnvoyConfigOptions) -> dict[str, Any]:
    """The bootstrap as plain data (what ``render`` serialises)."""
    clusters = [policyd_cluster(options), model_cluster(options)]
    if options.otlp_endpoint:
        host, _, port = options.otlp_endpoint.rpartition(":")
        clusters.append(grpc_cluster("otlp_collector", host, int(port), "1s"))
    return {
        "admin": {"address": socket_address("127.0.0.1", options.admin_port)},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": TYPE_URL
                        + "envoy.extensions.resource_monitors.downstream_connections.v3"
                        ".DownstreamConnectionsConfig",
                        "max_active_downstream_connections": options.max_connections,
                    },
                }
            ]
        },
        "layered_runtime": {
            "layers": [
                {"name": "policyd", "static_layer": dict(RUNTIME_FLAGS)},
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "static_resources": {"listeners": [listener(options)], "clusters": clusters},
    }


def render(options: EnvoyConfigOptions) -> str:
    header = (
        "# Envoy bootstrap generated by `policyd envoy-config`: Envoy asks policyd\n"
        "# (ext_proc) where each inference request goes. See docs/serving.md.\n"
    )
    return header + yaml.safe_dump(bootstrap(options), sort_keys=False, width=100)


def _policyd_hosts(options: EnvoyConfigOptions) -> list[str]:
    if not options.policyd_addresses:
        return [options.policyd_address]
    return [address.rpartition(":")[0] for address in options.policyd_addresses]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- the command -----------------------------------------------------------------------


def register(name: str, parser: argparse.ArgumentParser) -> None:
    defaults = EnvoyConfigOptions()
    parser.add_argument("--port", type=int, default=defaults.port, help="listener port")
    parser.add_argument(
        "--listen-address",
        default=defaults.listen_address,
        help="listener address (0.0.0.0 in a container; default %(default)s)",
    )
    parser.add_argument("--policyd-address", default=defaults.policyd_address)
    parser.add_argument("--policyd-port", type=int, default=defaults.policyd_port)
    parser.add_argument(
        "--policyd-addresses",
        default="",
        help="several policyd replicas, host:port,host:port,... in the one cluster "
        "(replaces --policyd-address/--policyd-port; default: none)",
    )
    parser.add_argument("--admin-port", type=int, default=defaults.admin_port)
    parser.add_argument(
        "--buffer-limit-mib",
        type=float,
        default=defaults.buffer_limit_bytes / MIB,
        help="largest request body Envoy buffers for policyd (MiB; default %(default)s)",
    )
    parser.add_argument(
        "--message-timeout-ms",
        type=int,
        default=None,
        help="how long Envoy waits for each policyd reply "
        "(default 1000, 1000000 with --ext-proc-mode inference-pool)",
    )
    parser.add_argument(
        "--ext-proc-mode",
        choices=EXT_PROC_MODES,
        default=defaults.ext_proc_mode,
        help="the ext_proc filter's shape: buffered (policyd's own: BUFFERED request body, "
        "fails open) or inference-pool (as Istio generates it for an InferencePool's "
        "endpoint picker: FULL_DUPLEX_STREAMED bodies, trailers sent, fails closed; "
        "default %(default)s)",
    )
    parser.add_argument("--stream-idle-timeout-s", type=int, default=defaults.stream_idle_timeout_s)
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=defaults.request_timeout_s,
        help="how long a client may take to send its whole request (Envoy answers 408 past it; "
        "a request flow control holds counts until it is let go: keep it above 120 s; "
        "default %(default)g)",
    )
    parser.add_argument(
        "--request-headers-timeout-s",
        type=float,
        default=defaults.request_headers_timeout_s,
        help="how long a client may take to send its headers (default %(default)g)",
    )
    parser.add_argument(
        "--strip-header",
        action="append",
        default=[],
        metavar="NAME",
        help="also remove this client header as the request arrives (a header a policy "
        "matches on or keys flows by); repeatable. Removed by default: "
        + ", ".join(PRIORITY_HEADERS),
    )
    parser.add_argument(
        "--prefill-header",
        default=PREFILL_HEADER,
        metavar="NAME",
        help="the header policyd names a split request's prefill pod in (policyd serve "
        "--prefill-header); always removed from clients' requests (default %(default)s)",
    )
    parser.add_argument(
        "--trust-header",
        action="append",
        default=[],
        metavar="NAME",
        help="keep this client header (a trusted proxy in front sets it); repeatable",
    )
    parser.add_argument(
        "--policyd-streams-per-connection",
        type=int,
        default=defaults.policyd_streams_per_connection,
        help="streams per connection to policyd before Envoy opens another (default %(default)s)",
    )
    parser.add_argument(
        "--policyd-max-streams",
        type=int,
        default=defaults.policyd_max_streams,
        help="concurrent streams to policyd before Envoy answers 503 (default %(default)s)",
    )
    parser.add_argument("--policyd-tls-ca", type=Path, help="CA that signed policyd's cert")
    parser.add_argument("--policyd-tls-cert", type=Path, help="Envoy's client cert (mTLS)")
    parser.add_argument("--policyd-tls-key", type=Path, help="Envoy's client key (mTLS)")
    parser.add_argument("--policyd-tls-server-name", default="", help="SNI for policyd")
    parser.add_argument(
        "--model-servers",
        default="",
        help="the model servers, ip:port,ip:port,... or one name:port (a headless Service): "
        "Envoy then retries a refused request on the next pod policyd named "
        "(default: none, ORIGINAL_DST on the destination header, no retries)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=defaults.retries,
        help="retries on another pod, with --model-servers (default %(default)s)",
    )
    parser.add_argument("--otlp-endpoint", default="", help="host:port of an OTLP/gRPC collector")
    parser.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    parser.set_defaults(run=run)


def options_from(arguments: argparse.Namespace) -> EnvoyConfigOptions:
    tls = None
    if arguments.policyd_tls_ca is not None:
        tls = PolicydTls(
            arguments.policyd_tls_ca,
            arguments.policyd_tls_cert,
            arguments.policyd_tls_key,
            arguments.policyd_tls_server_name,
        )
    elif arguments.policyd_tls_cert or arguments.policyd_tls_key:
        raise ValueError("--policyd-tls-cert/--policyd-tls-key need --policyd-tls-ca")
    if (arguments.policyd_tls_cert is None) != (arguments.policyd_tls_key is None):
        raise ValueError("--policyd-tls-cert and --policyd-tls-key go together")
    for flag in ("port", "policyd_port", "admin_port"):
        _check_port(f"--{flag.replace('_', '-')}", getattr(arguments, flag))
    if arguments.otlp_endpoint:
        _check_address("--otlp-endpoint", arguments.otlp_endpoint)
    if arguments.message_timeout_ms is not None and arguments.message_timeout_ms <= 0:
        raise ValueError("--message-timeout-ms must be positive")
    if arguments.stream_idle_timeout_s < 0:
        raise ValueError("--stream-idle-timeout-s must be >= 0 (0: none)")
    if arguments.request_timeout_s <= 0 or arguments.request_headers_timeout_s <= 0:
        raise ValueError("--request-timeout-s and --request-headers-timeout-s must be positive")
    if arguments.buffer_limit_mib <= 0:
        raise ValueError("--buffer-limit-mib must be positive")
    if arguments.policyd_streams_per_connection < 1 or arguments.policyd_max_streams < 1:
        raise ValueError("--policyd-streams-per-connection and --policyd-max-streams must be >= 1")
    model_servers = tuple(a.strip() for a in arguments.model_servers.split(",") if a.strip())
    for address in model_servers:
        _check_address("--model-servers", address)
    if len(model_servers) > 1 and not all(is_ip(a.rpartition(":")[0]) for a in model_servers):
        raise ValueError("--model-servers takes ip:port addresses or one name:port")
    policyd_addresses = tuple(
        a.strip() for a in arguments.policyd_addresses.split(",") if a.strip()
    )
    for address in policyd_addresses:
        _check_address("--policyd-addresses", address)
    if arguments.retries < 0:
        raise ValueError("--retries must be >= 0")
    stripped = [*PRIORITY_HEADERS, *(name.strip().lower() for name in arguments.strip_header)]
    for name in (name.strip().lower() for name in arguments.trust_header):
        if name not in stripped:
            raise ValueError(f"--trust-header {name}: not a header envoy-config removes")
        stripped = [kept for kept in stripped if kept != name]
    return EnvoyConfigOptions(
        listen_address=arguments.listen_address,
        port=arguments.port,
        policyd_address=arguments.policyd_address,
        policyd_port=arguments.policyd_port,
        admin_port=arguments.admin_port,
        buffer_limit_bytes=int(arguments.buffer_limit_mib * MIB),
        message_timeout_ms=arguments.message_timeout_ms,
        stream_idle_timeout_s=arguments.stream_idle_timeout_s,
        request_timeout_s=arguments.request_timeout_s,
        request_headers_timeout_s=arguments.request_headers_timeout_s,
        stripped_headers=tuple(dict.fromkeys(stripped)),
        prefill_header=arguments.prefill_header.strip().lower(),
        policyd_streams_per_connection=arguments.policyd_streams_per_connection,
        policyd_max_streams=arguments.policyd_max_streams,
        policyd_tls=tls,
        policyd_addresses=policyd_addresses,
        model_servers=model_servers,
        retries=arguments.retries,
        otlp_endpoint=arguments.otlp_endpoint,
        ext_proc_mode=arguments.ext_proc_mode,
    )


def _check_port(flag: str, port: int) -> None:
    """Envoy refuses a bootstrap with a port past 65535 only when it loads it: say so here."""
    if not 0 < port < 65536:
        raise ValueError(f"{flag} {port} is not a port (1-65535)")


def _check_address(flag: str, address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} takes host:port addresses, not {address!r}")
    _check_port(f"{flag} {address}:", int(port))


def run(arguments: argparse.Namespace) -> int:
    try:
        options = options_from(arguments)
    except ValueError as error:
        print(f"policyd envoy-config: {error}", file=sys.stderr)
        return 2
    remote = [host for host in _policyd_hosts(options) if not _is_loopback(host)]
    if remote and options.policyd_tls is None:
        print(
            f"policyd envoy-config: warning: policyd at {', '.join(remote)} is reached in plain "
            "text: every request header but the credentials crosses the network unencrypted "
            "(--policyd-tls-ca; docs/serving.md, TLS)",
            file=sys.stderr,
        )
    text = render(options)
    if arguments.output is None:
        sys.stdout.write(text)
    else:
        arguments.output.write_text(text)
    return 0
