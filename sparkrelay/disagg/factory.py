"""The PD role of --disaggregation-mode (disagg/roles.py says what a role does)."""

from __future__ import annotations

import torch

from sparkrelay.config import Config
from sparkrelay.disagg.roles import Role


def build_role(config: Config, dtype: torch.dtype) -> Role:
    """The role of --disaggregation-mode; a prefill binds its bootstrap server and stage-report
    inbox here, before the pipeline stages load (they register with the one and report to the
    other)."""
    mode = config.disagg.disaggregation_mode
    if mode == "prefill":
        # the transfer agents load only for a PD role
        from sparkrelay.disagg.prefill_role import (
            PrefillRole,
        )

        return PrefillRole(config, dtype)
    if mode == "decode":
        from sparkrelay.disagg.decode_role import DecodeRole

        return DecodeRole(config, dtype)
    return Role()
