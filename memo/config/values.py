"""One setting's value, parsed or checked: lengths in tokens, fractions, names from a list.

Every failure is a :class:`ConfigError` whose message is one line naming the key, its value and
what to write instead; ``run.py`` prints it without a traceback.
"""

import math
import re
from typing import Optional


class ConfigError(ValueError):
    """A user-fixable mistake in the configuration; the message is one line."""


class DoesNotFit(ConfigError):
    """No way to run a job fits the machine, as the fit predicts it before anything is allocated
    (memo.fit.choice): its row's status is ``oom``."""


_SEQ = re.compile(r"(\d+)([kK]?)")


def parse_seq(value: object, key: str = "seq") -> int:
    """Return the sequence length in tokens for ``value`` (an int or a string like ``"64k"``).

    ``4096`` and ``"4096"`` are tokens; ``"4k"`` and ``"1408k"`` count k = 1024 tokens.

    Raises:
        ConfigError: if ``value`` is not a positive whole number of tokens or of k (naming ``key``,
            the setting it was given as).
    """
    match = _SEQ.fullmatch(str(value).strip())
    tokens = int(match.group(1)) * (1024 if match.group(2) else 1) if match else 0
    if tokens <= 0:
        raise ConfigError(
            f"{key}={value} is not a sequence length: write a positive number of tokens "
            "as 4096, 4k or 1408k (k = 1024 tokens)"
        )
    return tokens


def parse_alpha(value: object, key: str = "alpha") -> Optional[float]:
    """``value`` as a number in [0, 1], or ``None`` for "auto".

    Raises:
        ConfigError: if ``value`` is neither "auto" nor a number in [0, 1].
    """
    if str(value).strip() == "auto":
        return None
    try:
        alpha = float(value)
    except ValueError:
        alpha = math.nan
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"{key}={value} must be a number in [0, 1] or auto")
    return alpha


def choice(key: str, value, allowed) -> None:
    """Refuse ``value`` of ``key`` unless it is one of ``allowed``."""
    if value not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ConfigError(f"{key}={value} is not allowed; choose one of: {shown}")


def at_least(key: str, value, minimum: int = 1) -> None:
    """Refuse ``value`` of ``key`` below ``minimum``."""
    if value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")
