"""--disaggregation-transfer-backend: each name is one carrier composed with the two agents
(prefill_agent.py, decode_agent.py), which are the same for every backend. A new backend is a
carrier file and one line here."""

from __future__ import annotations

from dataclasses import dataclass

from sparkrelay.transfer.decode_agent import DecodeAgent
from sparkrelay.transfer.frames import FramesCarrier
from sparkrelay.transfer.onesided import OneSidedCarrier
from sparkrelay.transfer.prefill_agent import PrefillAgent

# name -> (carrier class, its arguments); each agent gets its own carrier (a one-sided one owns its engine)
CARRIERS = {
    "zmq": (FramesCarrier, ()),
    "mooncake": (OneSidedCarrier, ("mooncake",)),
    "nixl": (OneSidedCarrier, ("nixl",)),
}


@dataclass(frozen=True)
class Backend:
    """A transfer backend: agents built with their constructor arguments (transfer/base.py's
    PrefillTransfer and DecodeTransfer), each composed with a new carrier of this backend."""

    name: str
    carrier: type
    args: tuple

    @property
    def one_sided(self) -> bool:
        return self.carrier.one_sided

    def prefill(self, *args, **kwargs) -> PrefillAgent:
        return PrefillAgent(*args, carrier=self.carrier(*self.args), **kwargs)

    def decode(self, *args, **kwargs) -> DecodeAgent:
        return DecodeAgent(*args, carrier=self.carrier(*self.args), **kwargs)


def get_backend(name: str) -> Backend:
    """The named backend; ValueError naming the valid ones. A one-sided engine's library is imported
    when its agent opens it, not here."""
    entry = CARRIERS.get(name)
    if entry is None:
        raise ValueError(f"unknown transfer backend {name!r}; valid: {', '.join(sorted(CARRIERS))}")
    return Backend(name, *entry)
