"""`python -m sparkrelay.pipeline.worker --rank R --world-size N [--port P]`: pipeline stage R (1 <= R
< N).

Started by rank 0 (pipeline/launch.py), with its launch record, JSON, in SPARKRELAY_PP_LAUNCH:
    config (Config.flat()), dtype, partition, num_blocks, capture (CaptureSpec.to_dict()),
    sink_factory, status_address, backend, threads, alone_threads, parent_pid.
Life: (NCCL only: connect to the launcher's TCPStore on 127.0.0.1:P) -> load layers [start, end) of
the target (load_causal_lm) and a KVPool for them with rank 0's num_blocks and page size (block tables
come in each descriptor) -> report StageLoaded to the launcher's LoadBoard (or the error) -> connect
the wire (WirePlan) -> serve micro-batches until a SHUTDOWN descriptor
(passed on first). An error of its own exits with code 1 (rank 0's watchdog names the stage); losing a peer
exits with PEER_LOST_EXIT (3), which the watchdog does not take for the root cause; the parent's death exits too.
Threads: threads = cpu_count // pp_size (at least 1) while other stages may be busy, and
alone_threads (rank 0's own setting) for a step's last micro-batch on the last stage, when the
others are done (Stage.share_cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from sparkrelay.config import Config
from sparkrelay.host import HeapTrimmer, reuse_freed_memory
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.models.quant import apply_torchao_config
from sparkrelay.pipeline.capture import CaptureSpec, PayloadShape
from sparkrelay.pipeline.comm import Channel, PeerLost, WirePlan, connect
from sparkrelay.pipeline.descriptor import SHUTDOWN
from sparkrelay.pipeline.launch import (
    LAUNCH_ENV,
    LOAD_TIMEOUT_S,
    PEER_LOST_EXIT,
    RENDEZVOUS_HOST,
    report_loaded,
)
from sparkrelay.pipeline.stage import Stage, build_stage


def watch_parent(parent_pid: int) -> None:
    """Exit when the engine process that started this worker is gone (re-parented)."""

    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=loop, name="sparkrelay-pp-parent", daemon=True).start()


def load(rank: int, launch: dict) -> tuple[Stage, PayloadShape, torch.device]:
    config = Config().replace(**launch["config"])
    dtype = getattr(torch, launch["dtype"])
    device = torch.device(f"cuda:{rank}" if launch["backend"] == "nccl" else config.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds this rank to its own GPU
    partition = [tuple(b) for b in launch["partition"]]
    start, end = partition[rank]
    model = load_causal_lm(
        config.model.model_path, start, end, dtype, str(device), config.model.load_format
    )
    apply_torchao_config(model, config.model.torchao_config)
    s = model.spec
    pool = KVPool(
        range(start, end),
        launch["num_blocks"],
        config.cache.page_size,
        s.num_kv_heads,
        s.head_dim,
        dtype,
        device,
    )
    capture = CaptureSpec.from_dict(launch["capture"])
    stage = build_stage(
        rank,
        partition,
        model,
        pool,
        capture,
        config,
        launch["sink_factory"],
        device,
        launch["status_address"],
        launch.get("bootstrap_url", ""),
    )
    return stage, PayloadShape.into_stage(rank, capture, partition, s.hidden_size, dtype), device


@torch.inference_mode()
def serve(stage: Stage, channel: Channel) -> None:
    """Receive, run, pass on, in micro-batch order, until SHUTDOWN; the freed heap goes back to the
    OS between micro-batches (host.py)."""
    heap = HeapTrimmer()
    while True:
        mb, inp = channel.recv_step()
        if mb.kind == SHUTDOWN:
            stage.release(mb.released)
            if not stage.is_last:
                channel.send_step(mb, None)
            channel.flush()
            stage.close()
            return
        out = stage.run(mb, inp=inp)
        if stage.is_last:
            channel.send_tokens(out)
        else:
            channel.flush()  # the previous micro-batch's sends, before posting this one's
            channel.send_step(mb, out)
        heap.maybe_trim()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument(
        "--port", type=int, default=None, help="the NCCL stages' TCPStore (CPU stages: none)"
    )
    args = ap.parse_args(argv)
    launch = json.loads(os.environ[LAUNCH_ENV])
    level = str(launch["config"].get("log_level", "info")).upper()
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s stage {args.rank} %(name)s: %(message)s"
    )
    watch_parent(launch["parent_pid"])
    reuse_freed_memory()
    torch.set_num_threads(launch["threads"])
    store = None
    if launch["backend"] == "nccl":
        store = dist.TCPStore(
            RENDEZVOUS_HOST,
            args.port,
            args.world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S),
        )
    try:
        stage, shape, device = load(args.rank, launch)
    except BaseException as e:
        report_loaded(launch["ipc_dir"], args.rank, f"{type(e).__name__}: {e}" or "failed")
        raise
    stage.share_cores(launch["alone_threads"], launch["threads"])
    report_loaded(launch["ipc_dir"], args.rank)
    plan = WirePlan.from_dict(args.world_size, launch["ipc_dir"], launch["wire"])
    wire = connect(store, args.rank, launch["backend"], plan, launch.get("token"))
    channel = Channel(wire, args.rank, args.world_size, launch["backend"], device, shape)
    try:
        serve(stage, channel)
    # another rank died or rank 0 went away: rank 0's watchdog reports the root cause
    except PeerLost as e:
        print(
            f"sparkrelay pipeline stage {args.rank}: stopping, a peer is gone: {e}",
            file=sys.stderr,
            flush=True,
        )
        return PEER_LOST_EXIT
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
