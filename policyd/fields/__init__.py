"""Every field a routing policy reads of a pod or a request, declared once.

``declared.py`` says, per field, its name, CEL kind, where its value comes
from (the pod's identity, a metric the model server exports and how its
series combine under each preset, the serving path, the scrape's time, the
request) and its doc line. Everything else is derived from it: the CEL
schema (``policyd.cel.schema``); the typed classes that
``python -m policyd.fields.generate`` writes and checks in (``Pod`` and
``PodMetrics`` in ``policyd.pool.pod_types``; ``Request`` and its ``decided``
copy in ``policyd.policy.request``; ``PolicyPod``, the ``Prefixed`` and
``AsSeen`` overlays and ``StaticPod``, the pods written by hand for
``policyd test`` / ``explain``, in ``policyd.policy.pods``; ``PrefixMatch``
in ``policyd.fields.prefix_match``; a test fails while one is stale); the
datastore's copying; the metric presets and ``--metric-*`` flags; the
decision log's and span's pod inputs; and the schema tables of
docs/policy-language.md (a test holds the tables to the declarations).

This room imports nothing of policyd, so every other room may import it.
"""

from policyd.fields.declared import (
    KV_CACHE,
    LORA_INFO,
    METRICS,
    NO_PREDICTION,
    POD_FIELDS,
    PREDICTION_POD_FIELDS,
    PREEMPTIONS,
    PREFIX_POD_FIELDS,
    PRESET_NAMES,
    PRESET_PATHS,
    REQUEST_FIELDS,
    RUNNING,
    SCRAPED_POD_FIELDS,
    WAITING,
    Field,
    Metric,
)

__all__ = [
    "KV_CACHE",
    "LORA_INFO",
    "METRICS",
    "NO_PREDICTION",
    "POD_FIELDS",
    "PREDICTION_POD_FIELDS",
    "PREEMPTIONS",
    "PREFIX_POD_FIELDS",
    "PRESET_NAMES",
    "PRESET_PATHS",
    "REQUEST_FIELDS",
    "RUNNING",
    "SCRAPED_POD_FIELDS",
    "WAITING",
    "Field",
    "Metric",
]
