"""Sizes in bytes as people write them: ``4GiB``, ``4GB``, ``512 MiB``, ``1.5TiB`` or a plain number.

One parser for the config (``device_budget``, ``host_budget``, ``keep_gathered``) and the planner's
command line (``python -m ds_patrickstar.plan --host-mem 22GiB``), so both accept the same text and
refuse it with the same message.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-z]*)\s*$")
EXAMPLES = "e.g. 4GiB (4 x 2**30 bytes), 4GB (4 x 10**9), 512MiB, 1.5TiB or a number of bytes"


def parse_bytes(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (KiB, MiB, GiB, TiB: powers of 1024; KB,
    MB, GB, TB: powers of 1000; B; any case). Raises ``ValueError`` naming the text and what works."""
    match = _SIZE.match(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write {EXAMPLES}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
