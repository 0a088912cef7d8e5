"""Request state and sampling parameters (plain Python, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

MAX_TOP_LOGPROBS = 20  # OpenAI's limit; a PD metadata row carries this many for the first token
# A request with this bootstrap host never contacts a peer (SGLang's FAKE_BOOTSTRAP_HOST, its
# warm-up and /health_generate requests): a prefill computes it and sends nothing, a decode decodes
# it from zero KV
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


_INT64 = range(-(2**63), 2**63)


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
    # vLLM's penalties (1.0 / 0.0: off): repetition on prompt + output tokens, frequency and
    # presence on output only
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # SGLang's logprob fields: record the target's log-softmax of the chosen tokens (and the top
    # ones); with logprob_start_len >= 0 also of the prompt tokens from that index (-1: output
    # tokens only)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    # SGLang's structured-output fields, at most one set: the output follows this JSON schema,
    # regular expression or EBNF grammar (sparkrelay/grammar/, --grammar-backend)
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.verify()

    def verify(self) -> None:
        """The one check of every value (HTTP routes, the offline API and the pipeline all build
        through here); raises RequestError naming the SGLang field, which the HTTP layer answers
        with a 400."""
        if self.max_new_tokens < 0:
            raise RequestError(f"`max_new_tokens` must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise RequestError(f"`temperature` must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"`top_p` must be in (0, 1], got {self.top_p}")
        for name in (
            "top_k",
            "seed",
        ):  # both end up in int64 tensors or torch.Generator.manual_seed
            if getattr(self, name) is not None and getattr(self, name) not in _INT64:
                raise RequestError(
                    f"`{name}` must fit in a signed 64-bit integer, got {getattr(self, name)}"
                )
        if self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"`top_k` must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"`min_p` must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise RequestError("`stop` strings must be non-empty")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"`top_logprobs_num` must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}"
            )
        if self.logprob_start_len < -1:
            raise RequestError(
                f"`logprob_start_len` must be -1 (output only) or >= 0, got {self.logprob_start_len}"
            )
        if not self.repetition_penalty > 0:
            raise RequestError(f"`repetition_penalty` must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"`{name}` must be in [-2, 2], got {getattr(self, name)}")
        for name in GRAMMAR_FIELDS:
            if not isinstance(getattr(self, name), (str, type(None))):
                raise RequestError(f"`{name}` must be a string")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise RequestError(f"at most one of {', '.join(given)} may be set")
        if given and not getattr(self, given[0]):
            raise RequestError(f"`{given[0]}` must not be empty")

    @property
    def grammar(self) -> Optional[tuple[str, str]]:
        """(field, text) of the grammar the output must follow, or None."""
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def logprobs_k(self) -> int:
        """-1: no logprobs; else how many top logprobs to record per position (0: the chosen token's
        only)."""
        return self.top_logprobs_num if self.return_logprob else -1

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Any penalty away from its default (requests without one never build a token history)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def sampler_fields(self) -> dict:
        """The fields the sampler reads (SAMPLER_FIELDS), by name: what a pipeline stage needs to
        sample."""
        return {name: getattr(self, name) for name in SAMPLER_FIELDS}


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # grammar/backends.py KINDS

# What runner/sampler.py reads of SamplingParams (penalties, filters, seed); the pipeline descriptor
# carries exactly these columns, so a new sampling rule is a field here and its use in the sampler,
# nothing in between.
SAMPLER_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


@dataclass(frozen=True)
class Bootstrap:
    """The PD routing fields the router adds to a request (docs/pd_protocol.md, the router's
    fields): where the prefill's bootstrap server is (port None: the decode server's
    --disaggregation-bootstrap-port) and the transfer's room."""

    host: str
    port: Optional[int]
    room: int

    @property
    def peer_room(self) -> Optional[int]:
        """The room a peer knows this request by; None for the fake host (no peer ever hears of
        it)."""
        return None if self.host == FAKE_BOOTSTRAP_HOST else self.room


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence being generated. `n > 1` requests are split into n Requests before they get
    here."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[dict] = None
    # Tokens whose KV is in the cache. A preempted request recomputes from 0 (or from its prefix
    # cache hit).
    num_computed: int = 0
    cached_tokens: int = (
        0  # leading tokens found in the prefix cache (SGLang's meta_info.cached_tokens)
    )
    handoff_bytes: int = (
        0  # PD decode: the bytes its prefill handed off for it (KV, drafter context, metadata row)
    )
    block_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    # Text detokenized so far (engine-side stop-string checks) and how many output ids it covers.
    output_text: str = ""
    num_preemptions: int = 0
    # speculative decoding: verify rounds and the tokens they committed (the prefill token not
    # counted)
    spec_verify_ct: int = 0
    spec_committed: int = 0
    # PD disaggregation: the transfer's room (0: none); the first position the drafter's context
    # starts at (a `tail` handoff leaves earlier prompt positions without draft context)
    bootstrap_room: int = 0
    draft_ctx_start: int = 0
    # logprobs (params.return_logprob): one entry per output token; per prompt position from
    # logprob_start_len
    logprobs: Optional["Logprobs"] = None
    # a grammar-constrained request's grammar/backends.py Matcher, advanced by every committed
    # token (the engine's _append); None without a grammar
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.params.return_logprob and self.logprobs is None:
            start = self.params.logprob_start_len
            self.logprobs = Logprobs(
                start, self.params.top_logprobs_num, self.prompt_ids[start:] if start >= 0 else []
            )

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
        """Known tokens with no KV yet; the next forward of this request feeds exactly these (or a
        chunk of them)."""
        return self.num_tokens - self.num_computed

    def finish(self, reason: dict) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason


TopLogprobs = list[tuple[float, int]]  # (logprob, token id), most likely first


@dataclass
class Logprobs:
    """What a request records. output[i] / output_top[i]: output token i. input[j] / input_top[j]:
    prompt position `input_start + j` (None at position 0, which has no logprob, as SGLang reports
    it)."""

    input_start: int = -1
    top: int = (
        0  # top logprobs per position (SGLang's top_logprobs_num; 0: no top lists in the answer)
    )
    input_ids: list[int] = field(default_factory=list)  # the prompt tokens from input_start on
    output: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input: list[Optional[float]] = field(default_factory=list)
    input_top: list[Optional[TopLogprobs]] = field(default_factory=list)

    def add_output(self, entries: list[tuple[float, TopLogprobs]]) -> None:
        self.output.extend(lp for lp, _ in entries)
        self.output_top.extend(top for _, top in entries)

    def add_input(self, first: int, entries: list[tuple[float, TopLogprobs]]) -> None:
        """Entries for prompt positions first, first + 1, ...; positions already recorded (a
        recomputed prompt) are skipped, so each position is recorded once."""
        if self.input_start < 0:
            return
        if not self.input and self.input_start == 0:
            self.input.append(None)
            self.input_top.append(None)
        done = self.input_start + len(self.input)
        for pos, (lp, top) in enumerate(entries, start=first):
            if pos == done:
                self.input.append(lp)
                self.input_top.append(top)
                done += 1

    def snapshot(self) -> "Logprobs":
        return Logprobs(
            self.input_start,
            self.top,
            self.input_ids,
            list(self.output),
            list(self.output_top),
            list(self.input),
            list(self.input_top),
        )

    def meta_info(
        self, output_ids: list[int], text_of: Optional[Callable[[int], str]] = None
    ) -> dict:
        """SGLang's meta_info fields: [logprob, token_id, text] triples (text None unless `text_of`
        is given), and per position a list of them for the top logprobs (only when top logprobs were
        asked)."""

        def triple(lp, tid):
            return [lp, tid, text_of(tid) if text_of is not None else None]

        def tops(top):
            return None if top is None else [triple(v, t) for v, t in top]

        meta = {
            "input_token_logprobs": [triple(lp, t) for lp, t in zip(self.input, self.input_ids)],
            "output_token_logprobs": [triple(lp, t) for lp, t in zip(self.output, output_ids)],
        }
        if self.top > 0:
            meta["input_top_logprobs"] = [tops(top) for top in self.input_top]
            meta["output_top_logprobs"] = [tops(top) for top in self.output_top]
        return meta


@dataclass(frozen=True)
class RequestOutput:
    """What the engine reports for a request after a step: the new tokens and, when finished,
    why."""

    rid: str
    new_ids: list[int]
    output_ids: list[int]
    finished: bool
    finish_reason: Optional[dict]
    prompt_tokens: int
    text: str = ""
    spec_verify_ct: int = 0
    spec_accept_length: Optional[float] = (
        None  # committed tokens per verify round (tau), when speculative
    )
    logprobs: Optional[Logprobs] = (
        None  # a snapshot of everything recorded so far (return_logprob only)
    )
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    handoff_bytes: int = 0  # PD decode only: the bytes its prefill handed off for it

    def meta_info(self, e2e_latency: float, text_of: Optional[Callable[[int], str]] = None) -> dict:
        """SGLang's meta_info (spec_* only when speculative decoding ran; the logprob fields only
        when asked, their token texts from `text_of` when given: return_text_in_logprobs)."""
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": e2e_latency,
        }
        if self.handoff_bytes:
            meta["handoff_bytes"] = self.handoff_bytes  # sparkrelay's own field (PD decode)
        if self.spec_accept_length is not None:
            meta["spec_verify_ct"] = self.spec_verify_ct
            meta["spec_accept_length"] = self.spec_accept_length
        if self.logprobs is not None:
            meta |= self.logprobs.meta_info(self.output_ids, text_of)
        return meta
