"""The decode agent's per-room record, the plan of the parts a room must receive, and the checks every incoming
frame of a room must pass (pure; used by transfer/zmq_decode.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sparkrelay.transfer.base import SCHEMA_MISMATCH, ExpectedParts, KVPoll, Part, PartSpec, SchemaCompare
from sparkrelay.transfer.frames import schema_mismatches

LIVE = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)
Addr = tuple[str, int]  # a prefill's bootstrap server
Dest = tuple[str, int]  # a prefill stage's PULL endpoint


@dataclass
class RoomRecord:
    addr: Addr
    prompt_len: int
    begun: float
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    expected: dict[int, dict[str, PartSpec]] = field(default_factory=dict)  # pp_rank -> name -> spec
    received: dict[int, dict[str, Part]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # stages whose STATUS success arrived
    endpoints: dict[int, Dest] = field(default_factory=dict)
    waiting_since: float = 0.0
    taken: bool = False
    permanent: bool = False  # refused for a reason a retry cannot cure (schema or auth mismatch, unplannable parts)
    told: bool = False  # an ABORT went to the prefill's stages


@dataclass
class PrefillRecord:
    """What the decode caches about one prefill (its bootstrap /route answers) until a room fails against it."""

    info: dict  # the server info, with "schema" and "pp_size"
    endpoints: dict[int, Dest] = field(default_factory=dict)  # pp_rank -> PULL endpoint, every stage


def part_problem(rec: RoomRecord, pp: int, spec: PartSpec, nbytes: int) -> Optional[str]:
    """Why a DATA frame does not fit the room, or None."""
    if rec.state == KVPoll.Bootstrapping:
        return "DATA before this decode sent its TRANSFER_INFO"
    stage = rec.expected.get(pp)
    if stage is None:
        return f"DATA from pp_rank {pp}, the room expects pp_rank(s) {sorted(rec.expected)}"
    if pp in rec.done:
        return f"DATA from pp_rank {pp} after its success STATUS"
    want = stage.get(spec.name)
    if want is None:
        return f"unexpected part {spec.name!r} from pp_rank {pp} (expected {sorted(stage)})"
    if spec.name in rec.received[pp]:
        return f"part {spec.name!r} from pp_rank {pp} arrived twice"
    if spec != want:
        return f"part {spec.name!r} from pp_rank {pp}: header {spec.header()} != expected {want.header()}"
    if nbytes != want.nbytes:
        return f"part {spec.name!r} from pp_rank {pp}: {nbytes} bytes, expected {want.nbytes}"
    return None


def success_problem(rec: RoomRecord, pp: int) -> Optional[str]:
    if pp not in rec.expected:
        return f"bad frame from the prefill: STATUS success from pp_rank {pp}, expected {sorted(rec.expected)}"
    missing = [n for n in rec.expected[pp] if n not in rec.received[pp]]
    if missing:
        return f"prefill pp_rank {pp} reported success but part(s) {missing} never arrived"
    return None


Plan = dict[int, dict[str, PartSpec]]  # pp_rank -> name -> the PartSpec the room must receive


def plan(compare: SchemaCompare, expected_parts: ExpectedParts, info: dict, ours: dict, prompt_len: int,
         max_part_bytes: int) -> tuple[str, Plan]:
    """(why the decode refuses a room of this prefill, or "", the parts it expects) from the prefill's server
    info. A schema mismatch starts with SCHEMA_MISMATCH and names each field with both values."""
    mismatches = schema_mismatches(compare, info["schema"], ours)
    if mismatches:
        return SCHEMA_MISMATCH + "; ".join(mismatches), {}
    try:
        wanted = expected_parts(info["schema"], prompt_len)
    except ValueError as e:
        return str(e), {}
    except Exception as e:
        return f"expected_parts raised {type(e).__name__}: {e}", {}
    expected: Plan = {pp: {} for pp in range(info["pp_size"])}
    for pp, specs in wanted.items():
        if pp not in expected:
            return f"expected_parts names pp_rank {pp}, the prefill has pp_size {info['pp_size']}", {}
        for spec in specs:
            if spec.name in expected[pp]:
                return f"expected_parts lists part {spec.name!r} of pp_rank {pp} twice", {}
            if spec.nbytes > max_part_bytes:
                return (f"part {spec.name!r} of pp_rank {pp} is {spec.nbytes} bytes, over max_part_bytes "
                        f"{max_part_bytes}"), {}
            expected[pp][spec.name] = spec
    return "", expected
