"""The pod pool: discovery (static file, Kubernetes), metrics scraping, snapshots.

``Pool`` ties the parts together; requests read ``Pool.snapshot()``, an
immutable ``PoolSnapshot``. The Kubernetes source lives in
``policyd.pool.kubernetes_discovery`` and is imported only where it is used.
"""

from policyd.pool.datastore import PoolSnapshot, ScrapeStats
from policyd.pool.discovery import Discovery, DiscoveryError, PodIdentity
from policyd.pool.exposition import ExpositionError, MetricsParser, PodMetrics
from policyd.pool.file_discovery import StaticFileDiscovery, parse_pod_file
from policyd.pool.metric_names import PRESETS, MetricNames, MetricSpec
from policyd.pool.pod import InFlight, Pod
from policyd.pool.pool import Pool
from policyd.pool.scraper import ScrapeConfig, ScrapeResult

__all__ = [
    "PRESETS",
    "Discovery",
    "DiscoveryError",
    "ExpositionError",
    "InFlight",
    "MetricNames",
    "MetricSpec",
    "MetricsParser",
    "Pod",
    "PodIdentity",
    "PodMetrics",
    "Pool",
    "PoolSnapshot",
    "ScrapeConfig",
    "ScrapeResult",
    "ScrapeStats",
    "StaticFileDiscovery",
    "parse_pod_file",
]
