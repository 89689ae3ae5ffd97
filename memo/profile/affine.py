"""A size affine in tokens, from two traces of the same work at two lengths."""

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Affine:
    """``base + slope·tokens`` bytes (or elements), exact in fractions."""

    base: Fraction
    slope: Fraction

    @classmethod
    def through(cls, a: int, b: int, tokens: tuple[int, int]) -> "Affine":
        """The line through ``(tokens[0], a)`` and ``(tokens[1], b)``."""
        slope = Fraction(b - a, tokens[1] - tokens[0])
        return cls(a - slope * tokens[0], slope)

    def at(self, tokens: int) -> int:
        return int(self.base + self.slope * tokens)
