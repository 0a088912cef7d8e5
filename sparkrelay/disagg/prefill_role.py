"""The prefill role (--disaggregation-mode prefill): rank 0 of a pipeline of --pp-size stages, each
stage with its own transfer agent (disagg/prefill_sink.py).

    take       the request is scheduled as usual (chunked prefill); its room travels with the step descriptor
    send       the first token is sampled: the engine detached the request (it keeps its blocks) -> in flight
    receive    every stage reported Success -> HandedOff (the request finishes with its one token)
               one stage reported Failed    -> HandoffFailed; the blocks are freed either way
A request with the fake bootstrap host is computed like any other and finishes once its first token is sampled:
no stage sends anything for it (room 0).
"""

from __future__ import annotations

import torch

from sparkrelay.config import Config
from sparkrelay.disagg.roles import NEWS_WAIT_S, Event, HandedOff, HandoffFailed, PDRole
from sparkrelay.disagg.stage_report import StageReport, StageReportInbox
from sparkrelay.pipeline.capture import CaptureSpec
from sparkrelay.pipeline.needs import RunnerNeeds
from sparkrelay.scheduler.request import Bootstrap, Request
from sparkrelay.transfer.base import SCHEMA_MISMATCH, KVPoll
from sparkrelay.transfer.bootstrap import BootstrapServer
from sparkrelay.transfer.wire import check_advertised

SINK_FACTORY = "sparkrelay.disagg.prefill_sink:make_stage_sink"


class PrefillRole(PDRole):
    name = "prefill"
    sends_first_token = True

    def __init__(self, config: Config, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        # a bad knob is a ConfigError before any socket is bound
        capture = CaptureSpec.from_config(config)
        # so is a wildcard bootstrap host without SPARKRELAY_HOST_IP (docs/pd_across_hosts.md)
        check_advertised(config.disagg.disaggregation_bootstrap_host, self.env.host_ip)
        self.pp_size = config.parallel.pp_size
        self.inbox = self._report_inbox(config)
        # stages at any --pp-size, each with the sink that sends its part and reports to the inbox;
        # in `tail` mode the rows of the last tail positions come from the request's own compute,
        # never the cache (the stages keep no tail rows beside cached pages; hidden and draft-kv
        # context is kept beside them)
        tail = max(1, self.schema.tail_tokens) if self.schema.handoff == "tail" else 1
        self.needs = RunnerNeeds(
            pipeline=True,
            sink_factory=SINK_FACTORY,
            capture=capture,
            status_address=self.inbox.address,
            computed_tail=tail,
        )
        dc = config.disagg
        self.bootstrap = BootstrapServer(
            dc.disaggregation_bootstrap_host,
            dc.disaggregation_bootstrap_port,
            self.pp_size,
            self.schema.to_dict(),
            config.server.port,
            config.cache.page_size,
            self.schema.dtype,
            auth_token=self.env.token(dc.disaggregation_auth_token),
            host_ip=self.env.host_ip,
        )
        self.bootstrap.start()  # before the stages load: they register with it
        self.inflight: dict[int, set[int]] = {}  # room -> stages that reported Success
        self.local: list[
            Request
        ] = []  # fake-bootstrap requests whose first token is sampled: nothing to send

    def _report_inbox(self, config: Config) -> StageReportInbox:
        """Loopback when every stage runs here; across hosts, node 0's pipeline address with the
        authenticated reports (pipeline/nodes.py)."""
        pc = config.parallel
        if pc.nnodes == 1:
            return StageReportInbox()
        token = self.env.token(config.disagg.disaggregation_auth_token)
        return StageReportInbox(pc.init_host_port()[0], token)

    def take(self, req: Request, bootstrap: Bootstrap) -> bool:
        self._register(req, bootstrap)
        return (
            False  # scheduled even with max_new_tokens 0: the decode peer waits for this room's KV
        )

    def send(self, reqs: list[Request]) -> None:
        for req in reqs:
            if req.bootstrap_room:
                self.inflight.setdefault(req.bootstrap_room, set())
            else:
                self.local.append(req)

    def receive(self) -> list[Event]:
        events: list[Event] = [HandedOff(req) for req in self.local]
        self.local = []
        for report in self.inbox.drain():
            events.extend(self._on_report(report))
        return events

    def _on_report(self, r: StageReport) -> list[Event]:
        req = self.by_room.get(r.room)
        if req is None or req.is_finished:
            return []
        if r.state == KVPoll.Failed:
            self.inflight.pop(r.room, None)
            # 400: deterministic, the router must not retry
            code = 400 if SCHEMA_MISMATCH in r.reason else 500
            return [
                HandoffFailed(
                    req,
                    f"KV transfer of room {r.room} failed on prefill stage {r.stage}: {r.reason}",
                    code,
                )
            ]
        done = self.inflight.setdefault(r.room, set())
        done.add(r.stage)
        if len(done) == self.pp_size and req.output_ids:
            self.inflight.pop(r.room)
            return [HandedOff(req)]
        return []

    def wait(self, idle: bool) -> None:
        """No polling sleep: until a stage reports or a request arrives (wake), NEWS_WAIT_S at
        most."""
        if idle and self.inflight:
            self.inbox.wait(NEWS_WAIT_S)

    def wake(self) -> None:
        self.inbox.wake()

    def drop(self, req: Request) -> None:
        self.inflight.pop(req.bootstrap_room, None)
        if req in self.local:
            self.local.remove(req)
        super().drop(req)

    def has_work(self) -> bool:
        return bool(self.inflight or self.local)

    def stats(self) -> dict:
        return {"num_transfers_inflight": len(self.inflight)}

    def close(self) -> None:
        self.bootstrap.stop()
        self.inbox.close()
