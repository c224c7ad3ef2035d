"""Byte sizes written by people on the command line ("64M", "1GiB", "4096"), parsed and checked.

Imports nothing heavy, so a CLI can use it while building its --help.
"""

from __future__ import annotations

import re

from fivefold.errors import ConfigError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*$")


def parse_bytes(text: str, option: str = "--bytes") -> int:
    """'1G', '256MiB', '4k', '4096' -> bytes (binary multiples); anything else, or zero, is a ConfigError naming `option`."""
    match = _SIZE.match(str(text))
    nbytes = int(float(match.group(1)) * 1024 ** " KMGT".index(match.group(2).upper() or " ")) if match else 0
    if nbytes < 1:
        raise ConfigError(f"{option} {text!r}: write a positive size such as 4096, 64M or 1GiB")
    return nbytes
