"""``python -m policyd.policy.kinds``: rewrite policy.schema.json from the registered kinds."""

import json
from pathlib import Path
from typing import Any

from policyd.policy.kinds import json_schema


def dump(value: Any, indent: str = "") -> str:
    """JSON with two-space indents; what fits in a 100-column line stays on one."""
    line = json.dumps(value, ensure_ascii=False)
    if len(indent) + len(line) <= 100 or not isinstance(value, dict | list) or not value:
        return line
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {dump(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    return "[\n" + ",\n".join(inner + dump(item, inner) for item in value) + f"\n{indent}]"


path = Path(__file__).resolve().parents[1] / "policy.schema.json"
schema = json_schema(json.loads(path.read_text(encoding="utf-8")))
path.write_text(dump(schema) + "\n", encoding="utf-8")
print(f"wrote {path}")
