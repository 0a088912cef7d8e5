"""What the engine's PD role asks of the runner, in one record: the role states it, the engine and
the pipeline read it, and neither tests --disaggregation-mode (an aggregated engine has the default
record)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sparkrelay.pipeline.capture import CaptureSpec


@dataclass(frozen=True)
class RunnerNeeds:
    # run stage processes even at --pp-size 1: a prefill's sinks live on the stages
    pipeline: bool = False
    # "module:function" building each stage's StageSink (pipeline/stage.py), or None: no sink
    sink_factory: Optional[str] = None
    # what the stages capture for the drafter's context (DSpark under PD)
    capture: CaptureSpec = field(default_factory=CaptureSpec)
    # where each stage's sink reports its part of a room's transfer ("": nowhere)
    status_address: str = ""
    # prompt positions at the end that are always computed, whatever the prefix cache holds
    computed_tail: int = 1
