"""Process logging for ``policyd serve``: one line per event, text or JSON.

Log collectors (Kubernetes, journald, Loki) split on newlines, so an event
never spans lines: a multi-line message (a rejected policy lists one
``file:line:col`` problem per line) or a traceback is folded into the one
line, `` | ``-separated in text and as a JSON string in JSON. Every line
carries the process id, which tells ``--workers`` apart.

    2026-11-30T09:44:47.123Z INFO policyd.extproc.server [4242] policyd ext_proc listening on ...
    {"time": "2026-11-30T09:44:47.123Z", "level": "info", "logger": "policyd.extproc.server",
     "pid": 4242, "message": "policyd ext_proc listening on ..."}
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Final, TextIO

LEVELS: Final = ("debug", "info", "warning", "error")
FORMATS: Final = ("text", "json")


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _one_line(text: str) -> str:
    return " | ".join(line for line in text.splitlines() if line.strip())


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        return (
            f"{_timestamp(record)} {record.levelname} {record.name} [{record.process}] "
            f"{_one_line(message)}"
        )


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, object] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every logger's records at ``level`` and above to ``stream`` (stderr)."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # The Kubernetes client's HTTP pool warns on every retry; policyd's discovery
    # already logs each failure once with its back-off. Shown with --log-level debug.
    logging.getLogger("urllib3").setLevel(logging.DEBUG if level == "debug" else logging.ERROR)
