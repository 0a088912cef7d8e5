"""A stage's report to rank 0 is a codec message (sparkrelay/codec.py): it survives the wire, and
anything else a socket delivers is a FrameError naming what is wrong, never a report."""

import msgpack
import pytest

from sparkrelay.codec import FrameError
from sparkrelay.disagg.stage_report import StageReport
from sparkrelay.transfer.base import KVPoll


@pytest.mark.parametrize(
    "report",
    [StageReport(7, 0, KVPoll.Success), StageReport((1 << 63) - 1, 3, KVPoll.Failed, "peer lost")],
)
def test_a_report_survives_the_wire(report):
    got = StageReport.decode(report.encode())
    assert got == report and got.state is report.state


@pytest.mark.parametrize(
    "head,needle",
    [
        (
            {
                "type": "STAGE_REPORT",
                "room": 7,
                "stage": 0,
                "state": int(KVPoll.Transferring),
                "reason": "",
            },
            "state",
        ),
        (
            {
                "type": "STAGE_REPORT",
                "room": 7,
                "stage": -1,
                "state": int(KVPoll.Success),
                "reason": "",
            },
            "stage",
        ),
        (
            {
                "type": "STAGE_REPORT",
                "room": 7,
                "stage": True,
                "state": int(KVPoll.Success),
                "reason": "",
            },
            "stage",
        ),
        (
            {
                "type": "STAGE_REPORT",
                "room": 0,
                "stage": 0,
                "state": int(KVPoll.Success),
                "reason": "",
            },
            "room",
        ),
        (
            {
                "type": "STAGE_REPORT",
                "room": 7,
                "stage": 0,
                "state": int(KVPoll.Failed),
                "reason": 5,
            },
            "reason",
        ),
        ({"type": "STATUS", "room": 7}, "expected a STAGE_REPORT"),
    ],
)
def test_a_bad_report_is_a_frame_error(head, needle):
    with pytest.raises(FrameError, match=needle):
        StageReport.decode([msgpack.packb(head)])


def test_garbage_is_a_frame_error():
    for frame in (b"", b"\xc1", msgpack.packb([1, 2]), b"\x00" * (70 << 10)):
        with pytest.raises(FrameError):
            StageReport.decode([frame])
