"""Decision spans (OpenTelemetry), Prometheus metrics and the decision log.

What ``policyd serve`` wires up::

    telemetry = build_telemetry(decision_log="-", decision_log_sample_rate=0.1)
    server = ExtProcServer(routers, snapshots, telemetry=telemetry, ...)
    metrics = telemetry.metrics                        # DecisionMetrics (or None)
    metrics.policies_loaded(store.current)
    store.watch(on_reload=metrics.on_reload)
    metrics.registry.register(PoolCollector(pool, decisions=metrics))
    metrics.registry.register(PrefixCollector(index, subscriber, pool.snapshot))
    endpoint = start_metrics_server("0.0.0.0", 9090, metrics.registry, ready=pool_ready)
    ...
    endpoint.close(); telemetry.shutdown()

See ``docs/observability.md`` for the span, metric and log formats.
"""

from policyd.telemetry.decision_log import DecisionLog
from policyd.telemetry.fanout import combine
from policyd.telemetry.http import MetricsServer, start_metrics_server
from policyd.telemetry.metrics import DecisionMetrics
from policyd.telemetry.pool_metrics import PoolCollector
from policyd.telemetry.prefix_metrics import PrefixCollector
from policyd.telemetry.record import DecisionTelemetry, RequestRecord
from policyd.telemetry.tracing import DecisionTracer
from policyd.telemetry.wiring import (
    build_telemetry,
    tracer_from_env,
    tracing_configured,
)

__all__ = [
    "DecisionLog",
    "DecisionMetrics",
    "DecisionTelemetry",
    "DecisionTracer",
    "MetricsServer",
    "PoolCollector",
    "PrefixCollector",
    "RequestRecord",
    "build_telemetry",
    "combine",
    "start_metrics_server",
    "tracer_from_env",
    "tracing_configured",
]
