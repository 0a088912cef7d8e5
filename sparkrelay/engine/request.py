"""Request state and sampling parameters (plain Python, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class RequestError(ValueError):
    """A request that cannot be served as asked; the message says why (maps to HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameter names. temperature 0 (or top_k 1) is greedy."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.verify()

    def verify(self) -> None:
        if self.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass(frozen=True)
class Bootstrap:
    """The PD routing fields the router adds to a request (PD_PROTOCOL.md §1.4): where the prefill's bootstrap
    server is (port None: the decode server's --disaggregation-bootstrap-port) and the transfer's room."""

    host: str
    port: Optional[int]
    room: int


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence being generated. `n > 1` requests are split into n Requests before they get here."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[dict] = None
    # Tokens whose KV is in the cache. A preempted request recomputes from 0.
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    # Text detokenized so far (engine-side stop-string checks) and how many output ids it covers.
    output_text: str = ""
    num_preemptions: int = 0
    # speculative decoding: verify rounds and the tokens they committed (the prefill token not counted)
    spec_verify_ct: int = 0
    spec_committed: int = 0
    # PD disaggregation: the transfer's room (0: none); the first position the drafter's context starts at (a
    # `tail` handoff leaves earlier prompt positions without draft context)
    bootstrap_room: int = 0
    draft_ctx_start: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def num_uncomputed(self) -> int:
        """Known tokens with no KV yet; the next forward of this request feeds exactly these (or a chunk of them)."""
        return self.num_tokens - self.num_computed

    def finish(self, reason: dict) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason


@dataclass(frozen=True)
class RequestOutput:
    """What the engine reports for a request after a step: the new tokens and, when finished, why."""

    rid: str
    new_ids: list[int]
    output_ids: list[int]
    finished: bool
    finish_reason: Optional[dict]
    prompt_tokens: int
    text: str = ""
    spec_verify_ct: int = 0
    spec_accept_length: Optional[float] = None  # committed tokens per verify round (tau), when speculative

    def meta_info(self, e2e_latency: float) -> dict:
        """SGLang's meta_info (spec_* only when speculative decoding ran)."""
        meta = {"id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.output_ids),
                "finish_reason": self.finish_reason, "e2e_latency": e2e_latency}
        if self.spec_accept_length is not None:
            meta["spec_verify_ct"] = self.spec_verify_ct
            meta["spec_accept_length"] = self.spec_accept_length
        return meta
