"""Environment switches: one parser for the `MOETRAIN_*` variables that pick a code path."""
from __future__ import annotations

import os
from typing import Sequence


def env_choice(var: str, choices: Sequence[str]) -> str:
    """The value of `var`, lower-cased: "auto" (unset) or one of `choices`; anything else is refused
    naming the variable and what it accepts."""
    value = os.environ.get(var, "auto").lower()
    if value not in ("auto", *choices):
        raise ValueError(f"{var}={value!r}: use auto, {', '.join(choices)}")
    return value
