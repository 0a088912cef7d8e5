"""The transfer engines behind the one-sided backends: Mooncake's TransferEngine and NVIDIA's NIXL
agent, each wrapped to the same five calls. Nothing above this module imports either library.

    engine = open_engine("mooncake" | "nixl", host)   # start it, or EngineMissing naming what to install
    engine.register(addr, nbytes)                     # memory a peer may write into, or that we write from
    engine.peer()                                     # (peer id, metadata bytes) a writer needs to reach us
    engine.write(peer, [(src, dst, nbytes), ...])     # one-sided writes into the peer's registered memory; blocks
    engine.close()

Mooncake: P2PHANDSHAKE (no metadata server); the peer id is "host:rpc_port". Its protocol is RDMA
when the host has an RDMA device and TCP otherwise (SPARKRELAY_MOONCAKE_PROTOCOL overrides;
SPARKRELAY_MOONCAKE_DEVICE names the devices). Its handshake and TCP data sockets listen on every
interface (Mooncake 0.3.13 offers no bind address).
NIXL: the UCX backend; the peer id is the agent name and the metadata is the agent's (it lists
registered memory), loaded once per peer by the writer. UCX's sockets are kept on the loopback
device when `host` is a loopback address.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from sparkrelay.transfer.wire import interface_of

Write = tuple[int, int, int]  # (local source address, peer destination address, bytes)
MOONCAKE_BATCH = (
    1024  # Mooncake refuses larger batches (4096 failed with -1 in a probe; 1024 works)
)
NIXL_TIMEOUT_S = 60.0
NIXL_PROGRESS_DELAY_US = (
    100  # the agent's progress thread sleeps this long between rounds (see _paced_agent)
)


class EngineMissing(RuntimeError):
    """The engine's Python package or a system library it needs is not installed."""


class EngineError(RuntimeError):
    """A transfer the engine could not do."""


class TransferEngine(Protocol):
    def register(self, addr: int, nbytes: int) -> None: ...
    def unregister(self, addr: int) -> None: ...
    def peer(self) -> tuple[str, bytes]: ...
    def write(self, peer: tuple[str, bytes], writes: list[Write]) -> None: ...
    def close(self) -> None: ...


def _missing(backend: str, e: ImportError) -> EngineMissing:
    text = str(e)
    if "libibverbs" in text or "libnl" in text or "librdmacm" in text:
        return EngineMissing(
            f"--disaggregation-transfer-backend {backend}: {text}. Install the RDMA user-space "
            "libraries: `apt-get install libibverbs1` (Debian/Ubuntu; scripts/setup.sh does it "
            "when run as root)"
        )
    extra = {
        "mooncake": "mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine on a CUDA host)",
        "nixl": "nixl-cu12",
    }[backend]
    return EngineMissing(
        f"--disaggregation-transfer-backend {backend}: {text}. Install it with "
        f"`pip install -e .[{backend}]` ({extra})"
    )


def open_engine(backend: str, host: str) -> TransferEngine:
    """A started engine of the named kind bound for `host`; EngineMissing when it is not
    installed."""
    if backend == "mooncake":
        return MooncakeEngine(host)
    if backend == "nixl":
        return NixlEngine(host)
    raise ValueError(f"no transfer engine {backend!r}")


def buffer_address(data: bytes | bytearray | memoryview) -> int:
    """The address of a bytes-like object's buffer, no copy (the caller keeps it alive while an
    engine reads it)."""
    return int(np.frombuffer(data, np.uint8).ctypes.data)


# ---- Mooncake ------------------------------------------------------------------------------------


def _rdma_devices() -> list[str]:
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


class MooncakeEngine:
    def __init__(self, host: str) -> None:
        try:
            from mooncake.engine import TransferEngine as Mooncake
        except ImportError as e:
            raise _missing("mooncake", e) from None
        protocol = os.environ.get("SPARKRELAY_MOONCAKE_PROTOCOL") or (
            "rdma" if _rdma_devices() else "tcp"
        )
        if protocol not in ("tcp", "rdma"):
            raise ValueError(
                f"SPARKRELAY_MOONCAKE_PROTOCOL={protocol!r}: valid values are tcp and rdma"
            )
        devices = os.environ.get("SPARKRELAY_MOONCAKE_DEVICE") or (
            ",".join(_rdma_devices()) if protocol == "rdma" else ""
        )
        self._engine = Mooncake()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, devices)
        if rc != 0:
            raise EngineError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {devices!r}) "
                f"returned {rc}"
            )
        self._id = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol

    def register(self, addr: int, nbytes: int) -> None:
        if self._engine.register_memory(addr, nbytes) != 0:
            raise EngineError(f"Mooncake register_memory({addr:#x}, {nbytes}) failed")

    def unregister(self, addr: int) -> None:
        self._engine.unregister_memory(addr)

    def peer(self) -> tuple[str, bytes]:
        return self._id, b""

    def write(self, peer: tuple[str, bytes], writes: list[Write]) -> None:
        for i in range(0, len(writes), MOONCAKE_BATCH):
            batch = writes[i : i + MOONCAKE_BATCH]
            src, dst, n = (list(col) for col in zip(*batch))
            rc = self._engine.batch_transfer_sync_write(peer[0], src, dst, n)
            if rc != 0:
                raise EngineError(f"Mooncake write of {sum(n)} bytes to {peer[0]} failed (rc {rc})")

    def close(self) -> None:
        self._engine = None  # the library frees its engine with the object


# ---- NIXL ----------------------------------------------------------------------------------------


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def _nixl_api():
    """NIXL's agent classes: from the CUDA-12 wheel this project installs, else any build the `nixl`
    package finds."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError as first:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            raise _missing("nixl", first) from None
    return nixl_agent, nixl_agent_config


def _paced_agent(name: str):
    """A NIXL agent with the UCX backend whose progress thread sleeps NIXL_PROGRESS_DELAY_US between
    rounds. The Python API hard-codes a delay of 0: that thread then spins a whole core even when
    idle, which on a small host starves the engines; without the thread a target never completes a
    write. Paced, it costs next to nothing (figures: speed notes of docs/architecture.md). Callers
    hold NixlEngine._env_lock."""
    nixl_agent, nixl_agent_config = _nixl_api()
    bind = sys.modules[nixl_agent.__module__].nixlBind
    base = bind.nixlAgentConfig

    class Paced(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, NIXL_PROGRESS_DELAY_US if key == "pthrDelay" else value)

    bind.nixlAgentConfig = Paced
    try:
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    finally:
        bind.nixlAgentConfig = base


class NixlEngine:
    _env_lock = threading.Lock()

    def __init__(self, host: str) -> None:
        with self._env_lock:
            # UCX reads it when the agent starts: keep its sockets on the device that holds `host`
            # (else it listens on every device, loopback included); a user's UCX_NET_DEVICES wins
            device = "lo" if _loopback(host) else interface_of(host)
            if device is not None:
                os.environ.setdefault("UCX_NET_DEVICES", device)
            self._name = f"sparkrelay-{os.getpid()}-{secrets.token_hex(4)}"
            self._agent = _paced_agent(self._name)
        self._regs: dict[int, object] = {}
        self._peers: dict[str, bytes] = {}  # peer name -> the metadata we loaded for it
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> None:
        with self._lock:
            self._regs[addr] = self._agent.register_memory([(addr, nbytes, 0, "")], "DRAM")

    def unregister(self, addr: int) -> None:
        with self._lock:
            reg = self._regs.pop(addr, None)
        if reg is not None:
            self._agent.deregister_memory(reg)

    def peer(self) -> tuple[str, bytes]:
        return self._name, self._agent.get_agent_metadata()

    def _load(self, name: str, metadata: bytes) -> None:
        with self._lock:
            if self._peers.get(name) == metadata:
                return
            if name in self._peers:
                self._agent.remove_remote_agent(name)
            loaded = self._agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                raise EngineError(f"NIXL metadata names agent {loaded!r}, the decode said {name!r}")
            self._peers[name] = metadata

    def write(self, peer: tuple[str, bytes], writes: list[Write]) -> None:
        name, metadata = peer
        self._load(name, metadata)
        local = self._agent.get_xfer_descs([(s, n, 0) for s, _, n in writes], "DRAM")
        remote = self._agent.get_xfer_descs([(d, n, 0) for _, d, n in writes], "DRAM")
        handle = self._agent.initialize_xfer("WRITE", local, remote, name)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + NIXL_TIMEOUT_S
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise EngineError(
                    f"NIXL write of {sum(n for *_, n in writes)} bytes to {name} ended {state!r}"
                )
        finally:
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        for addr in list(self._regs):
            self.unregister(addr)
        self._agent = None


def engine_error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if not isinstance(e, (EngineError, EngineMissing)) else str(e)
