"""Command-line flags for the pod pool, for every command that runs one.

A command calls ``add_arguments(parser)`` when it builds its parser and
``pool_from_arguments(args)`` when it runs; contradictions and bad values
raise ``ValueError`` with a message for the operator. ``docs/pool.md``
describes every flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from policyd.fields import METRICS
from policyd.fields.roles import ROLE_LABEL
from policyd.pool.discovery import Discovery
from policyd.pool.file_discovery import StaticFileDiscovery
from policyd.pool.metric_names import PRESETS, MetricSpec, specs
from policyd.pool.pool import Pool
from policyd.pool.scraper import ScrapeConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pods = parser.add_argument_group("pods (give --pods, --k8s-selector or --inference-pool)")
    pods.add_argument("--pods", metavar="FILE", help="YAML file listing the pods, watched")
    pods.add_argument(
        "--pods-poll-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often the pod file is checked for changes (default 1)",
    )
    pods.add_argument(
        "--k8s-selector",
        metavar="SELECTOR",
        help="follow the Kubernetes pods matching this label selector, e.g. app=vllm",
    )
    pods.add_argument(
        "--inference-pool",
        metavar="NAME",
        help="follow the pods and target ports of this InferencePool"
        " (inference.networking.k8s.io/v1) in --k8s-namespace, and its changes",
    )
    pods.add_argument("--k8s-namespace", metavar="NAME", help="default: policyd's own namespace")
    pods.add_argument(
        "--k8s-target-port",
        type=int,
        metavar="PORT",
        help="the pods' serving port with --k8s-selector (default 8000)",
    )
    pods.add_argument(
        "--kubeconfig", metavar="FILE", help="default: in-cluster, then ~/.kube/config"
    )
    pods.add_argument("--k8s-context", metavar="NAME", help="kubeconfig context to use")
    pods.add_argument(
        "--role-label",
        default=ROLE_LABEL,
        metavar="LABEL",
        help=f"the pod label that gives pod.role: prefill, decode or both (default {ROLE_LABEL})",
    )

    scrape = parser.add_argument_group("metrics scraping")
    scrape.add_argument(
        "--scrape-interval", type=float, default=0.1, metavar="SECONDS", help="default 0.1"
    )
    scrape.add_argument(
        "--scrape-timeout", type=float, metavar="SECONDS", help="default 3/4 of the interval"
    )
    scrape.add_argument(
        "--stale-after",
        type=float,
        metavar="SECONDS",
        help="metrics older than this take a pod out of the candidates (default 5 intervals)",
    )
    scrape.add_argument(
        "--include-stale",
        action="store_true",
        help="keep pods with failed or stale scrapes as candidates (see pod.metrics_age)",
    )
    scrape.add_argument(
        "--no-panic",
        action="store_true",
        help="when no pod answers a scrape round, answer 503 instead of routing on the pods"
        " heard from within --stale-after",
    )
    scrape.add_argument(
        "--metrics-preset",
        choices=sorted(PRESETS),
        default="vllm",
        help="the model server's metric names (default vllm)",
    )
    for metric in METRICS:
        scrape.add_argument(
            f"--metric-{metric.key}",
            action="append",
            metavar="SPEC",
            help=f'metric for {metric.help}, name or name{{label="value"}}; repeat for fallbacks'
            + ("" if metric.required else "; an empty value turns it off"),
        )
    scrape.add_argument("--metrics-path", metavar="PATH", help="default: the preset's")
    scrape.add_argument(
        "--no-metrics-filter",
        action="store_true",
        help="request the whole metrics page instead of only the families read (name[]=...)",
    )
    scrape.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="scrape this port instead of the pod's"
    )
    scrape.add_argument(
        "--scrape-in-process",
        action="store_true",
        help="scrape on the serving event loop instead of in a scraper child process",
    )


def pool_from_arguments(args: argparse.Namespace) -> Pool:
    return Pool(
        discovery_from_arguments(args),
        scrape_config_from_arguments(args),
        role_label=args.role_label,
    )


def discovery_from_arguments(args: argparse.Namespace) -> Discovery:
    given = [args.pods, args.k8s_selector, args.inference_pool]
    if sum(source is not None for source in given) != 1:
        raise ValueError(
            "give exactly one of --pods FILE, --k8s-selector SELECTOR and --inference-pool NAME"
        )
    if args.pods is not None:
        return StaticFileDiscovery(Path(args.pods), poll_interval=args.pods_poll_interval)
    if args.inference_pool is not None and args.k8s_target_port is not None:
        raise ValueError(
            "--k8s-target-port goes with --k8s-selector: the InferencePool names its ports"
        )
    from policyd.pool.kubernetes_discovery import (  # noqa: PLC0415 - only when used
        KubernetesDiscovery,
        KubernetesOptions,
    )

    return KubernetesDiscovery(
        KubernetesOptions(
            selector=args.k8s_selector or "",
            target_port=args.k8s_target_port or 8000,
            inference_pool=args.inference_pool,
            namespace=args.k8s_namespace,
            kubeconfig=args.kubeconfig,
            context=args.k8s_context,
        )
    )


def scrape_config_from_arguments(args: argparse.Namespace) -> ScrapeConfig:
    names = PRESETS[args.metrics_preset]
    changes: dict[str, tuple[MetricSpec, ...]] = {}
    for metric in METRICS:
        written = getattr(args, "metric_" + metric.key.replace("-", "_"))
        if written:
            changes[metric.key] = specs(*(text for text in written if text.strip()))
    metrics = names.replace(**changes)
    if args.metrics_path is not None:
        metrics = dataclasses.replace(metrics, path=args.metrics_path)
    return ScrapeConfig(
        interval=args.scrape_interval,
        timeout=args.scrape_timeout,
        stale_after=args.stale_after,
        include_stale=args.include_stale,
        panic=not args.no_panic,
        metrics=metrics,
        metrics_port=args.metrics_port,
        filter_families=not args.no_metrics_filter,
        in_process=args.scrape_in_process,
        preset=args.metrics_preset,
    )
