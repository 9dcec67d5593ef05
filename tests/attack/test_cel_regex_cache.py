"""Attack: a rule matching against a request-supplied pattern fills memory with compiled regexes.

``request.model.matches(request.headers["x-re"])`` compiles each new pattern
and kept the last 512 compiled, whatever their size: 400 patterns of 20,000
characters held about 470 MB. The cache now holds a bounded number of bytes.
"""

from __future__ import annotations

from pathlib import Path

from policyd.cel import Environment, pod_type, request_type
from policyd.policy.request import Request

# The cache's 32 MiB and RE2's transient use, far under what 400 patterns took.
RESIDENT_CEILING = 96 * 1024 * 1024


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_request_supplied_patterns_do_not_grow_memory_without_bound() -> None:
    program = Environment({"pod": pod_type(), "request": request_type()}).compile(
        'request.model.matches(request.headers["x-re"])'
    )
    before = resident_bytes()
    for index in range(400):
        pattern = f"{index:05d}" + "a" * 20_000
        request = Request(model="zz", headers={"x-re": pattern})
        assert program.evaluate({"request": request, "pod": None}) is False
    assert resident_bytes() - before < RESIDENT_CEILING
