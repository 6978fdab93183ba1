"""Where JSON values end, found one character at a time (for parsers fed in pieces).

Only nesting and strings matter: `depth` counts open {[ outside strings. A value is
complete when depth returns to where it started; json.loads then judges it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class JsonDepth:
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    @property
    def outside(self) -> bool:
        """Between values at the top level (not inside a string or a bracket)."""
        return self.depth == 0 and not self.in_string
