"""PipelineRunner: ModelRunner's interface (`run(batch) -> RunResult`, `release(rid)`) over `--pp-size` stages.

One step on rank 0 (inside the engine thread), N = pp_size:

    batch -> up to N micro-batches (contiguous runs of sequences, balanced by fed tokens)
    for each micro-batch:  stage 0 forward -> post (descriptor, payload) to rank 1    (stages 1.. overlap with 0)
    then:                  receive each micro-batch's tokens from rank N-1 -> RunResult in batch order

Stages 1..N-1 are worker processes (pipeline/worker.py), started and watched by pipeline/launch.py;
every send and receive is in pipeline/comm.py. With pp_size 1 (the prefill role always uses this
runner) stage 0 is the whole
model: no torch.distributed, no subprocess. Rank 0's stage 0 shares the engine's loaded model and KV
pool. Decode batches (one token per running request) take the same path, so aggregated serving runs
with PP.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import json
import os
import shutil
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch

from sparkrelay.config import Config, ConfigError
from sparkrelay.envs import DisaggEnv
from sparkrelay.grammar.rows import masks
from sparkrelay.host import socket_folder
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.decoder import CausalLM
from sparkrelay.pipeline.comm import Channel, PeerLost, WirePlan, connect
from sparkrelay.pipeline.descriptor import SHUTDOWN, STEP, MicroBatch, SeqDesc, reply_shape
from sparkrelay.pipeline.launch import LoadBoard, Workers, rendezvous_store
from sparkrelay.pipeline.needs import RunnerNeeds
from sparkrelay.pipeline.nodes import NodeHub, node_token
from sparkrelay.pipeline.partition import pp_partition
from sparkrelay.pipeline.stage import build_stage, model_view, pool_view
from sparkrelay.runner.logprobs import from_rows
from sparkrelay.runner.model_runner import RunResult, prompt_rows
from sparkrelay.scheduler.request import Request
from sparkrelay.scheduler.scheduler import Batch, ScheduledSeq
from sparkrelay.transfer.bootstrap import bootstrap_url as url_of
from sparkrelay.transfer.wire import check_advertised, local_host

# Chunk pipelining (PipelineRunner._plan): a cut prefill step's chunks hold at least CHUNK_TOKENS
# tokens, and there are at most CHUNKS_PER_STAGE per stage. Each chunk pays a fixed cost on every
# stage (its layers' weights read again, attention set-up), and the pipeline fills and drains with
# one chunk: too small a chunk pays the fixed cost too often, too large a one fills and drains
# slowly; 256 gave the lowest PD TTFT measured (speed notes of docs/architecture.md).
CHUNK_TOKENS, CHUNKS_PER_STAGE = 256, 4


def bootstrap_url(config: Config) -> str:
    """Where the stage sinks reach the prefill's bootstrap server: on one host its local address (a wildcard:
    loopback); across hosts the address it advertises (SPARKRELAY_HOST_IP, else --disaggregation-bootstrap-host),
    which every node reaches."""
    dc = config.disagg
    host = local_host(dc.disaggregation_bootstrap_host)
    if config.parallel.nnodes > 1:
        host = check_advertised(dc.disaggregation_bootstrap_host, DisaggEnv.read().host_ip)
    return url_of(host, dc.disaggregation_bootstrap_port)


def shared_threads(pp: int) -> int:
    """Torch threads of a stage while the others may be busy: the host's cores split between the pp
    stages."""
    return max(1, (os.cpu_count() or 1) // pp)


def default_room(req: Request) -> int:
    """The request's PD bootstrap room (0: none)."""
    return int(getattr(req, "bootstrap_room", None) or 0)


def split_balanced(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 cut into min(parts, len) non-empty contiguous runs of about equal
    total size."""
    n, total = min(parts, len(sizes)), sum(sizes)
    runs, cur, acc = [], [], 0
    for i, size in enumerate(sizes):
        cur.append(i)
        acc += size
        left_items, left_runs = len(sizes) - i - 1, n - len(runs) - 1
        if left_runs > 0 and (left_items == left_runs or acc * n >= total * (len(runs) + 1)):
            runs.append(cur)
            cur = []
    return runs + [cur]


def cut_tokens(sizes: list[int], parts: int) -> list[list[tuple[int, int, int]]]:
    """Sequences of `sizes` tokens, laid end to end, cut into `parts` runs of about equal tokens, cutting inside a
    sequence where a boundary falls -> per run, pieces (sequence index, first token offset, end offset)."""
    total = sum(sizes)
    bounds = [round(k * total / parts) for k in range(1, parts + 1)]
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    cursor, k = 0, 0
    for i, size in enumerate(sizes):
        lo = 0
        while lo < size:
            while bounds[k] <= cursor:
                k += 1
            hi = min(size, lo + bounds[k] - cursor)
            runs[k].append((i, lo, hi))
            cursor += hi - lo
            lo = hi
    return [r for r in runs if r]


class PipelineRunner:
    """needs: what the engine's role asks of the stages (capture, sink factory, status address;
    pipeline/needs.py), none for an aggregated pipeline. room_of: a request's bootstrap room (0:
    none)."""

    def __init__(
        self,
        config: Config,
        model: CausalLM,
        pool: KVPool,
        needs: RunnerNeeds = RunnerNeeds(),
        room_of: Callable[[Request], int] = default_room,
    ) -> None:
        pp, num_layers = config.parallel.pp_size, model.spec.num_layers
        try:
            self.partition = pp_partition(num_layers, pp)
            self.capture = needs.capture.validate(num_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        sink_factory, status_address = needs.sink_factory, needs.status_address
        self.pp, self.room_of = pp, room_of
        self.vocab_size = model.spec.vocab_size
        self.device = next(iter(pool.layers.values()))[0].device
        first = self.partition[0]
        self.stage = build_stage(
            0,
            self.partition,
            model_view(model, *first),
            pool_view(pool, *first),
            self.capture,
            config,
            sink_factory,
            self.device,
            status_address,
        )
        self.workers: Optional[Workers] = None
        self.hub: Optional[NodeHub] = None
        self.channel: Optional[Channel] = None
        self._ids: dict[str, tuple[int, int]] = {}  # rid -> (req_index, room)
        self._released: list[tuple[int, int]] = []
        self._req_counter, self._steps = itertools.count(), itertools.count()
        self._lock = threading.Lock()
        self._closed, self._broken = False, None
        self.stats = {"steps": 0, "micro_batches": 0}
        if pp > 1:
            self.stage.share_cores(
                torch.get_num_threads(), shared_threads(config.parallel.stages_per_node)
            )
            self._start_workers(config, model, pool, sink_factory, status_address)
        self._atexit = functools.partial(_close_ref, weakref.ref(self))
        atexit.register(self._atexit)

    # -- start-up ----------------------------------------------------------------------------------
    def _start_workers(
        self,
        config: Config,
        model: CausalLM,
        pool: KVPool,
        sink_factory: Optional[str],
        status_address: str,
    ) -> None:
        """Stages 1..k-1 as processes of this host; with --nnodes > 1 the other nodes' stages too, through the
        NodeHub (pipeline/nodes.py)."""
        cuda = self.device.type == "cuda"
        backend = (
            "nccl"
            if cuda and config.model.device == "cuda" and torch.cuda.device_count() >= self.pp
            else "ipc"
        )
        self._store = (  # NCCL's rendezvous, on 127.0.0.1 only; CPU stages need no TCP port
            rendezvous_store(config.parallel.dist_init_port, self.pp) if backend == "nccl" else None
        )
        # 0700: the stages' sockets (comm.py) and the load board
        self._ipc_dir = socket_folder("sparkrelay-pp-", f"rank{self.pp - 1}")
        self._board = LoadBoard(self._ipc_dir)
        try:
            plan, token = self._plan_wire(config)
            launch = {
                "config": config.flat(),
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "partition": self.partition,
                "num_blocks": pool.num_blocks,
                "capture": self.capture.to_dict(),
                "sink_factory": sink_factory,
                "status_address": status_address,
                "bootstrap_url": bootstrap_url(config),
                "backend": backend,
                "ipc_dir": self._ipc_dir,
                "wire": plan.to_dict(),
                "parent_pid": os.getpid(),
                "threads": shared_threads(config.parallel.stages_per_node),
                "alone_threads": torch.get_num_threads(),
            }
            if self.hub is not None:
                self.hub.launch(launch)
            local = [r for r in range(1, self.pp) if config.parallel.node_of(r) == 0]
            port = None if self._store is None else self._store.port
            self.workers = Workers(local, self.pp, port, json.dumps(dict(launch, token=token)))
            self.workers.wait_ready(self._board)
            if self.hub is not None:
                self.hub.wait_ready()
            wire = connect(self._store, 0, backend, plan, token)
        except BaseException:
            self._abandon()
            raise
        self.workers.watch()
        if self.hub is not None:
            self.hub.start()
        self.channel = Channel(wire, 0, self.pp, backend, self.device, health=self._health)

    def _plan_wire(self, config: Config) -> tuple[WirePlan, Optional[str]]:
        """One host: every inbox an ipc:// file. Several: wait for every node to join (its address), and
        authenticate the tcp:// links with the transfer token."""
        pc = config.parallel
        if pc.nnodes == 1:
            return WirePlan(self.pp, self._ipc_dir), None
        token = node_token(config)
        self.hub = NodeHub(config, token)
        hosts = self.hub.gather()
        node_of = tuple(pc.node_of(r) for r in range(self.pp))
        return WirePlan(
            self.pp, self._ipc_dir, node_of, tuple(hosts), pc.init_host_port()[1]
        ), token

    def _abandon(self) -> None:
        """A failed start: stop what was started."""
        if self.workers is not None:
            self.workers.stop(timeout=0)
        if self.hub is not None:
            self.hub.stop()
        self.stage.close()
        self._board.close()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _health(self) -> None:
        """Raises RuntimeError once a local stage process died or a node is lost (every wait polls it)."""
        self.workers.check()
        if self.hub is not None:
            self.hub.check()

    @property
    def worker_pids(self) -> list[int]:
        """pids of stages 1..N-1 (empty with pp_size 1)."""
        return self.workers.pids if self.workers is not None else []

    # -- the ModelRunner interface -----------------------------------------------------------------
    def release(self, rid: str) -> None:
        """Forget a finished or aborted request. Stage 0 (this process) drops it now, so its
        transfer agent fails an unsent room towards the decode at once; stages 1..N-1 hear of it
        with the next descriptor."""
        ident = self._ids.pop(rid, None)
        if ident is not None:
            self._released.append(ident)
            self.stage.release([ident])

    @property
    def rendezvous_port(self) -> Optional[int]:
        """The NCCL stages' TCPStore port (None: no pipeline, or CPU stages, which listen on no TCP port)."""
        return None if self.workers is None else self.workers.port

    @property
    def failure(self) -> Optional[str]:
        """Why the pipeline is down (a stage died or a send/receive failed), or None while it is
        up."""
        if self._broken is None:
            self._broken = self._down()
        return self._broken

    @torch.inference_mode()
    def run(self, batch: Batch) -> RunResult:
        with self._lock:
            self._check_up()
            seqs = batch.seqs
            # per micro-batch: (sequence index, the piece of it this micro-batch feeds)
            pieces = self._plan(batch)
            step, released = next(self._steps), self._take_released()
            tokens: list[torch.Tensor] = []  # per micro-batch [B_i + E_i, W_i] (Stage.run)
            mbs = []
            for i, run in enumerate(pieces):
                scored = {k: (first, n) for k, first, _, n in prompt_rows([p for _, p in run])}
                descs = [self._desc(p, *scored.get(k, (-1, 0))) for k, (_, p) in enumerate(run)]
                mb = MicroBatch(STEP, step, i, len(pieces), descs, released if i == 0 else [])
                mbs.append(mb)
                ids = [t for _, p in run for t in p.req.all_ids[p.start : p.end]]
                # stage 0 dropped them in release() already
                local = dataclasses.replace(mb, released=[])
                out = self.stage.run(local, input_ids=torch.tensor(ids, device=self.device))  # [T]
                if self.channel is None:
                    tokens.append(out)
                    continue
                with self._comm():
                    self.channel.send_step(mb, out)
            if self.stage.threads is not None:
                torch.set_num_threads(self.stage.threads[0])  # rank 0's own setting, between steps
            if self.channel is not None:
                with self._comm():
                    tokens = self.channel.recv_tokens([reply_shape(m.seqs) for m in mbs])
                    self.channel.flush()
            self.stats["steps"] += 1
            self.stats["micro_batches"] += len(pieces)
            return self._result(seqs, [j for run in pieces for j, _ in run], mbs, tokens)

    def _plan(self, batch: Batch) -> list[list[tuple[int, ScheduledSeq]]]:
        """The step's micro-batches. With several stages, a prefill step of at least 2 *
        CHUNK_TOKENS tokens is cut into up to CHUNKS_PER_STAGE * pp chunks of about equal tokens,
        cutting inside a prompt where needed (a request's chunks run in order on every stage, each
        after the previous one's KV is in place), so that stage s computes chunk k while stage s - 1
        computes chunk k + 1. Otherwise whole sequences are split into up to pp contiguous runs."""
        seqs = batch.seqs
        sizes = [s.end - s.start for s in seqs]
        parts = min(CHUNKS_PER_STAGE * self.pp, sum(sizes) // CHUNK_TOKENS)
        if self.pp == 1 or batch.kind != "prefill" or parts <= min(self.pp, len(seqs)):
            return [[(j, seqs[j]) for j in run] for run in split_balanced(sizes, self.pp)]
        return [
            [
                (j, dataclasses.replace(seqs[j], start=seqs[j].start + lo, end=seqs[j].start + hi))
                for j, lo, hi in run
            ]
            for run in cut_tokens(sizes, parts)
        ]

    def close(self) -> None:
        """Send the shutdown descriptor (with pending releases), join the workers (kill what
        lingers). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self._atexit)
            # stage 0 dropped them in release(); the others hear it now
            released = self._take_released()
            self.stage.close()
            if self.workers is None:
                return
            if self._down() is None:
                try:
                    self.channel.send_step(
                        MicroBatch(SHUTDOWN, next(self._steps), 0, 1, [], released), None
                    )
                    self.channel.flush()
                except PeerLost:
                    pass  # a stage died meanwhile: stop() below kills and reaps the rest
            self.workers.stop()
            if self.hub is not None:
                self.hub.stop()
            self.channel.close()
            self._board.close()
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self.channel = self._store = None

    # -- helpers -----------------------------------------------------------------------------------
    def _desc(self, s: ScheduledSeq, score_first: int = -1, score_count: int = 0) -> SeqDesc:
        """The sequence's descriptor row; it scores prompt positions [score_first, score_first +
        score_count)."""
        req, p = s.req, s.req.params
        if req.rid not in self._ids:
            self._ids[req.rid] = (next(self._req_counter), self.room_of(req))
        index, room = self._ids[req.rid]
        # the last stage penalises with it
        history = req.all_ids[: s.end] if s.sample and p.penalized else []
        return SeqDesc(
            index,
            room,
            s.start,
            s.end,
            len(req.prompt_ids),
            s.sample,
            list(req.block_ids),
            p,
            history,
            p.logprobs_k,
            score_first,
            req.prompt_ids[score_first : score_first + score_count],
            self._mask(req) if s.sample and req.grammar is not None else [],
        )

    def _mask(self, req: Request) -> list[int]:
        """The words of the tokens req's grammar allows next, for the last stage to sample under."""
        m = masks([req.grammar], self.vocab_size)
        return m.bitmask[0].tolist()

    @staticmethod
    def _result(
        seqs: list[ScheduledSeq], owners: list[int], mbs: list[MicroBatch], rows: list[torch.Tensor]
    ) -> RunResult:
        """Each micro-batch's reply [B_i + E_i, W_i] -> tokens (and logprob entries, prompt ones included) in batch
        order. owners: the batch index of each piece, in micro-batch order; only a sequence's last piece samples,
        and its pieces' scored prompt positions follow one another."""
        sampled: dict[int, tuple[list[float], SeqDesc]] = {}
        prompt: dict[int, tuple[int, list]] = {}
        piece = iter(owners)
        for mb, reply in zip(mbs, rows):
            r = reply.tolist()
            cursor = len(mb.seqs)
            for d, row in zip(mb.seqs, r):
                j, n = next(piece), len(d.score_ids)
                if d.sample:
                    assert row[0] >= 0, "a stage did not sample a sampling sequence"
                    sampled[j] = (row, d)
                if n:
                    prompt.setdefault(j, (d.score_first, []))[1].extend(
                        from_rows(r[cursor : cursor + n], [d.logprobs] * n)
                    )
                    cursor += n
        assert all((j in sampled) == s.sample for j, s in enumerate(seqs)), (
            "a stage sampled the wrong sequences"
        )
        res = RunResult(
            [[int(sampled[j][0][0])] if j in sampled else [] for j in range(len(seqs))],
            [s.end for s in seqs],
        )
        if any(d.logprobs >= 0 for mb in mbs for d in mb.seqs):
            res.logprobs = [
                from_rows([sampled[j][0][1:]], [sampled[j][1].logprobs])
                if j in sampled and sampled[j][1].logprobs >= 0
                else []
                for j in range(len(seqs))
            ]
            res.prompt_logprobs = [prompt.get(j) for j in range(len(seqs))]
        return res

    def _take_released(self) -> list[tuple[int, int]]:
        out, self._released = self._released, []
        return out

    def _check_up(self) -> None:
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        if self._broken is None:
            self._broken = self._down()
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _down(self) -> Optional[str]:
        """A local stage's death or a lost node, as recorded by their watchers."""
        if self.hub is not None and self.hub.failure is not None:
            return self.hub.failure
        return None if self.workers is None else self.workers.failure

    @contextmanager
    def _comm(self) -> Iterator[None]:
        """A failed send or receive means a stage is gone: name it, kill the rest, refuse further
        steps."""
        try:
            yield
        except PeerLost as e:
            self._broken = (
                self.hub.failure
                if self.hub is not None and self.hub.failure
                else self.workers.down_message(e)
            )
            self.workers.kill()
            raise RuntimeError(self._broken) from e


def _close_ref(ref: "weakref.ref[PipelineRunner]") -> None:
    runner = ref()
    if runner is not None:
        runner.close()
