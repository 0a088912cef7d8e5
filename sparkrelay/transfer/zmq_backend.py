"""The ZMQ/TCP transfer backend: PrefillAgent (one per prefill pipeline stage) and DecodeAgent (one per decode
server). Frames are in frames.py, the bootstrap HTTP server in bootstrap.py."""

from sparkrelay.transfer.zmq_decode import DecodeAgent
from sparkrelay.transfer.zmq_prefill import PrefillAgent

__all__ = ["DecodeAgent", "PrefillAgent"]
