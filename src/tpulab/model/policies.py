"""The KV-cache precisions, in one place and free of heavy imports (the CLI reads them for
--help)."""

from __future__ import annotations

import typing
from typing import Literal

Policy = Literal["fp32", "bf16", "int8"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)
