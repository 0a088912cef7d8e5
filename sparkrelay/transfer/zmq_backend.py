"""The "zmq" transfer backend (transfer.base.get_backend("zmq")): parts go as DATA frames over the same ZMQ/TCP
control channel as the messages. PrefillAgent: one per prefill pipeline stage; DecodeAgent: one per decode server."""

from sparkrelay.transfer.zmq_decode import DecodeAgent
from sparkrelay.transfer.zmq_prefill import PrefillAgent

__all__ = ["DecodeAgent", "PrefillAgent"]
