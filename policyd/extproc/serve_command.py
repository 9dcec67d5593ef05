"""``policyd serve``: the ext_proc service Envoy asks where each request goes.

    policyd serve --policy rules/default.yaml --pods pods.yaml [--port 9002]
    policyd serve --policy /etc/policyd/ --k8s-selector app=vllm --host 0.0.0.0 --workers 2

At start the policy is compiled (a bad one stops the service with every
``file:line:col`` problem, exit status 1) and so are the pod options (a
contradiction or a bad value: exit status 2). Then each worker loads the pods,
polls the policy file or directory for changes, scrapes the pods and serves
gRPC until SIGTERM or SIGINT, when it drains open streams for up to
``--grace-seconds``. Logs go to stderr, one line per event (``--log-format
json`` for collectors). Telemetry: Prometheus ``/metrics`` (with ``/healthz``
and ``/readyz``) on ``--monitoring-port``, decision spans exported over OTLP
when ``--otlp-endpoint`` or the standard ``OTEL_*`` variables say where, and
an optional JSON decision log. ``docs/cli.md`` lists every flag.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from pathlib import Path

from policyd.extproc.assembly import Policyd
from policyd.extproc.grpc_server import ServerOptions, TlsFiles
from policyd.extproc.logs import FORMATS, LEVELS, configure_logging
from policyd.extproc.replies import DESTINATION_HEADER, PREFILL_HEADER, is_header_name
from policyd.extproc.serving import ServingSettings
from policyd.extproc.workers import run_in_workers
from policyd.policy import PolicyError, PolicyStore
from policyd.pool import DiscoveryError
from policyd.pool.options import (
    add_arguments as add_pool_arguments,
)
from policyd.pool.options import (
    discovery_from_arguments,
    pool_from_arguments,
    scrape_config_from_arguments,
)
from policyd.prefix.options import add_arguments as add_prefix_arguments
from policyd.prefix.options import settings_from_arguments as prefix_from_arguments
from policyd.telemetry import (
    PoolCollector,
    PrefixCollector,
    build_telemetry,
    start_metrics_server,
)

log = logging.getLogger("policyd.extproc.serve")

MIB = 1024 * 1024
EXIT_RUNTIME_ERROR = 1
EXIT_USAGE = 2


class UsageError(ValueError):
    """Flags that cannot work together; the message is for the operator."""


def register(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        required=True,
        type=Path,
        metavar="PATH",
        help="policy file, or a directory of policy files (a policy set); hot-reloaded",
    )
    parser.add_argument(
        "--policy-poll-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often the policy files are checked for changes (default 1)",
    )
    parser.add_argument(
        "--policy-settle-seconds",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="load a changed policy only once its files stayed the same this long "
        "(default 1; 0 loads at once)",
    )
    parser.add_argument(
        "--accept-policy-warnings",
        action="store_true",
        help="let a reload replace the policy even when it brings warnings the serving one "
        "does not have, or loses all its filter nodes, shed nodes or scorers (default: refuse)",
    )
    server = parser.add_argument_group("gRPC server")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: 0.0.0.0 or :: in a container (default 127.0.0.1)",
    )
    server.add_argument("--port", type=int, default=9002, help="gRPC port (default 9002)")
    server.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes sharing the port, one core each (default 1)",
    )
    server.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long open streams may take to finish (default 30)",
    )
    server.add_argument("--tls-cert", type=Path, metavar="FILE", help="server certificate (PEM)")
    server.add_argument("--tls-key", type=Path, metavar="FILE", help="server private key (PEM)")
    server.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="require client certificates signed by this CA (mutual TLS)",
    )
    server.add_argument(
        "--send-fallbacks",
        action="store_true",
        help="append the fallback endpoints to the destination (only for an Envoy cluster "
        "that takes a list; ORIGINAL_DST does not)",
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-body-mib",
        type=float,
        default=16.0,
        metavar="MIB",
        help="largest request body policyd reads; 413 past it (default 16)",
    )
    limits.add_argument(
        "--max-buffered-body-mib",
        type=float,
        default=64.0,
        metavar="MIB",
        help="request-body bytes a worker holds at once, counted from content-length when "
        "the headers arrive; a request past it gets a 429 with Retry-After (default 64: "
        "see docs/serving.md for sizing against the container's memory)",
    )
    limits.add_argument(
        "--in-flight-expiry-seconds",
        type=float,
        default=330.0,
        metavar="SECONDS",
        help="a routed request without response headers after this long stops counting in "
        "its pod's in-flight; 0: never (default 330, above Envoy's 300 s stream idle timeout)",
    )
    parser.add_argument(
        "--prefill-header",
        default=PREFILL_HEADER,
        metavar="NAME",
        help="the request header naming a split request's prefill pod (host:port) to the"
        " decode pod's P/D sidecar (default %(default)s, llm-d's)",
    )
    add_pool_arguments(parser)
    add_prefix_arguments(parser)
    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument(
        "--monitoring-port",
        type=int,
        default=9090,
        metavar="PORT",
        help="Prometheus /metrics, /healthz and /readyz over HTTP; 0 turns it off; "
        "worker i of --workers listens on PORT+i (default 9090)",
    )
    telemetry.add_argument(
        "--monitoring-host",
        metavar="HOST",
        help="address of the monitoring endpoint (default: the same as --host)",
    )
    telemetry.add_argument(
        "--otlp-endpoint",
        default="",
        metavar="HOST:PORT",
        help="export decision spans over OTLP to this collector (default: as the "
        "OTEL_* environment variables say; none configured means no spans)",
    )
    telemetry.add_argument(
        "--span-usage",
        choices=("on", "off"),
        default="on",
        help="put the response's gen_ai.usage.* token counts on the decision span; off "
        "when the model servers trace too and their spans carry them (default on)",
    )
    telemetry.add_argument(
        "--decision-log",
        default="",
        metavar="PATH",
        help="write every decision as a JSON line to PATH, or - for standard output",
    )
    telemetry.add_argument(
        "--decision-log-sample-rate",
        type=float,
        default=1.0,
        metavar="RATE",
        help="share of decisions the log keeps, 0 to 1 (default 1)",
    )
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", choices=LEVELS, default="info", help="default info")
    logs.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="one line per event, as text or JSON (default text)",
    )
    parser.set_defaults(run=run)


def run(arguments: argparse.Namespace) -> int:
    try:
        check_arguments(arguments)
    except (UsageError, ValueError) as error:
        print(f"policyd serve: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        store = open_policy(arguments)
    except PolicyError as error:
        print(f"policyd serve: the policy does not load:\n{error}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    configure_logging(arguments.log_level, arguments.log_format)
    for warning in store.current.warnings:
        log.warning("policy: %s", warning)
    if arguments.workers == 1:
        return asyncio.run(serve(arguments, store))
    return run_in_workers(arguments.workers, serve_worker, arguments)


def open_policy(arguments: argparse.Namespace) -> PolicyStore:
    """The policy store, with the reload guards the flags ask for (``PolicyError``)."""
    return PolicyStore.open(
        arguments.policy,
        settle_seconds=arguments.policy_settle_seconds,
        refuse_new_warnings=not arguments.accept_policy_warnings,
    )


def check_arguments(arguments: argparse.Namespace) -> None:
    """Reject what cannot work before anything starts (raises ``UsageError``)."""
    if arguments.workers < 1:
        raise UsageError(f"--workers must be at least 1, not {arguments.workers}")
    if not 0 <= arguments.port < 65536:
        raise UsageError(f"--port must be from 0 to 65535, not {arguments.port}")
    if arguments.grace_seconds < 0:
        raise UsageError("--grace-seconds must not be negative")
    if not arguments.policy_poll_interval > 0:
        raise UsageError("--policy-poll-interval must be positive")
    if not arguments.policy_settle_seconds >= 0:
        raise UsageError("--policy-settle-seconds must not be negative")
    if (arguments.tls_cert is None) != (arguments.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if arguments.tls_client_ca is not None and arguments.tls_cert is None:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    for flag in ("tls_cert", "tls_key", "tls_client_ca"):
        path: Path | None = getattr(arguments, flag)
        if path is not None and not path.is_file():
            raise UsageError(f"--{flag.replace('_', '-')} {path}: no such file")
    if arguments.monitoring_port != 0 and not (
        0 < arguments.monitoring_port + arguments.workers - 1 < 65536
    ):
        raise UsageError(
            f"--monitoring-port must be from 0 to 65535, not {arguments.monitoring_port}"
        )
    if arguments.monitoring_port != 0 and arguments.monitoring_port <= arguments.port < (
        arguments.monitoring_port + arguments.workers
    ):
        raise UsageError("--monitoring-port and --port must not overlap")
    if not arguments.max_body_mib > 0:
        raise UsageError("--max-body-mib must be positive")
    if not arguments.max_buffered_body_mib >= arguments.max_body_mib:
        raise UsageError("--max-buffered-body-mib must be at least --max-body-mib")
    if not arguments.in_flight_expiry_seconds >= 0:
        raise UsageError("--in-flight-expiry-seconds must not be negative")
    if (
        not is_header_name(arguments.prefill_header)
        or arguments.prefill_header == DESTINATION_HEADER
    ):
        raise UsageError(f"--prefill-header {arguments.prefill_header!r}: not a header to use")
    if not 0 <= arguments.decision_log_sample_rate <= 1:
        raise UsageError("--decision-log-sample-rate must be from 0 to 1")
    if not arguments.policy.exists():
        raise UsageError(f"--policy {arguments.policy}: no such file or directory")
    discovery_from_arguments(arguments)  # ValueError: contradicting pod flags
    scrape_config_from_arguments(arguments)  # ValueError: bad scrape settings
    try:
        prefix_from_arguments(arguments).make_tokenizer()  # ValueError: bad prefix settings
    except RuntimeError as error:  # the tokenizers extra is not installed
        raise UsageError(str(error)) from None


def server_options(arguments: argparse.Namespace) -> ServerOptions:
    tls = None
    if arguments.tls_cert is not None:
        tls = TlsFiles(arguments.tls_cert, arguments.tls_key, arguments.tls_client_ca)
    host: str = arguments.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address, as gRPC wants it next to a port
    return ServerOptions(
        host=host,
        port=arguments.port,
        tls=tls,
        grace_seconds=arguments.grace_seconds,
        reuse_port=arguments.workers > 1,
        settings=ServingSettings(
            send_fallbacks=arguments.send_fallbacks,
            max_body_bytes=int(arguments.max_body_mib * MIB),
            max_buffered_body_bytes=int(arguments.max_buffered_body_mib * MIB),
            in_flight_expiry_seconds=arguments.in_flight_expiry_seconds,
            prefill_header=arguments.prefill_header,
        ),
    )


def freeze_startup_heap() -> None:
    """Take what start-up made out of the garbage collector's full passes.

    A full collection walks every tracked object, and start-up leaves tens of
    thousands that live as long as the process (modules, protobuf
    descriptors, the compiled policy). Under load full passes come every few
    seconds, and each stops the serving loop, holding up every open stream,
    for as long as its walk takes; frozen, the start-up heap is left out of
    that walk, which shortens each pass by an order of magnitude. A frozen
    object is never collected: one that later becomes garbage in a reference
    cycle stays, which bounds the cost by what start-up made.
    """
    gc.collect()
    gc.freeze()


def serve_worker(arguments: argparse.Namespace, worker: int) -> int:
    """One worker process of ``--workers N`` (started with spawn: it sets itself up)."""
    configure_logging(arguments.log_level, arguments.log_format)
    try:
        store = open_policy(arguments)
    except PolicyError as error:  # changed since the parent checked it
        log.error("the policy does not load:\n%s", error)
        return EXIT_RUNTIME_ERROR
    return asyncio.run(serve(arguments, store, worker))


async def serve(arguments: argparse.Namespace, store: PolicyStore, worker: int = 0) -> int:
    """Serve until a signal; the exit status. ``worker`` is the index among ``--workers``."""
    try:
        telemetry = build_telemetry(
            otlp_endpoint=arguments.otlp_endpoint,
            span_usage=arguments.span_usage == "on",
            worker=worker,
            decision_log=arguments.decision_log,
            decision_log_sample_rate=arguments.decision_log_sample_rate,
        )
    except ValueError as error:
        log.error("telemetry: %s", error)
        return EXIT_RUNTIME_ERROR
    metrics = telemetry.metrics
    assert metrics is not None  # build_telemetry keeps metrics unless asked not to
    pool = pool_from_arguments(arguments)
    metrics.registry.register(PoolCollector(pool, decisions=metrics))
    metrics.policies_loaded(store.current)
    service = Policyd(
        store,
        pool,
        server_options(arguments),
        telemetry=telemetry,
        policy_poll_seconds=arguments.policy_poll_interval,
        on_reload=metrics.on_reload,
        prefix=prefix_from_arguments(arguments),
    )
    prefix = service.prefix
    metrics.registry.register(
        PrefixCollector(prefix.locator.index, prefix.subscriber, pool.snapshot)
    )
    monitoring = None
    try:
        if arguments.monitoring_port:
            host = arguments.monitoring_host or arguments.host
            port = arguments.monitoring_port + worker
            try:
                monitoring = start_metrics_server(host, port, metrics.registry, ready=service.ready)
            except OSError as error:
                log.error("cannot serve metrics on %s port %d: %s", host, port, error)
                return EXIT_RUNTIME_ERROR
            log.info("metrics on http://%s:%d/metrics", host, monitoring.port)
        freeze_startup_heap()
        await service.run_until_signalled()
    except DiscoveryError as error:
        log.error("cannot load the pods: %s", error)
        return EXIT_RUNTIME_ERROR
    except OSError as error:
        log.error("cannot serve on %s port %d: %s", arguments.host, arguments.port, error)
        return EXIT_RUNTIME_ERROR
    finally:
        if monitoring is not None:
            monitoring.close()
        telemetry.shutdown()
    return 0
