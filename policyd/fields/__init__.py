"""Every field a routing policy reads of a pod or a request, declared once.

``declared.py`` says, per field, its name, CEL kind, where its value comes
from (the pod's identity, a metric the model server exports and how its
series combine under each preset, the serving path, the scrape's time, the
request) and its doc line. Everything else is derived from it: the CEL
schema (``policyd.cel.schema``), the ``Pod`` and ``PodMetrics`` types and
the datastore's copying (``policyd.pool``), the ``Request`` type and the
router's copy of it (``policyd.policy.request``), the metric presets and
``--metric-*`` flags, the pods written by hand for ``policyd test`` /
``explain``, the decision log's and span's pod inputs, and the schema tables
of docs/policy-language.md (a test holds the tables to the declarations).

This room imports nothing of policyd, so every other room may import it.
"""

from policyd.fields.declared import (
    KV_CACHE,
    LORA_INFO,
    METRICS,
    POD_FIELDS,
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
    dataclass_fields,
)

__all__ = [
    "KV_CACHE",
    "LORA_INFO",
    "METRICS",
    "POD_FIELDS",
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
    "dataclass_fields",
]
