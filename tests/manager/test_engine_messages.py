"""The messages between the HTTP server and the scheduler process: every kind survives the wire, a
bad frame is a MessageError, and nothing is pickled."""

from dataclasses import astuple, fields

import msgpack
import pytest

from sparkrelay.manager.messages import (
    AbortRequest,
    Added,
    AddItems,
    EngineInfo,
    Fatal,
    FrameReader,
    GenerationItem,
    MessageError,
    Progress,
    Ready,
    Shutdown,
    StartFailed,
    decode,
    encode,
    framed,
)
from sparkrelay.scheduler.request import Bootstrap, Logprobs, RequestOutput, SamplingParams


def _output(with_logprobs: bool) -> RequestOutput:
    lp = (
        Logprobs(
            0,
            2,
            [5, 6],
            [-0.5, -1.25],
            [[(-0.5, 7), (-2.0, 9)], [(-1.25, 8), (-3.0, 1)]],
            [None, -4.5],
            [None, [(-4.5, 6), (-0.1, 2)]],
        )
        if with_logprobs
        else None
    )
    return RequestOutput(
        "r1", [7, 8], [7, 8], True, {"type": "stop", "matched": "\n\n"}, 2, "héllo", 3, 2.5, lp
    )


@pytest.mark.parametrize(
    "msg",
    [
        AddItems(
            7,
            (
                GenerationItem(
                    "a",
                    [1, 2, 3],
                    SamplingParams(
                        max_new_tokens=4,
                        temperature=0.5,
                        stop=("x", "yz"),
                        stop_token_ids=(2,),
                        seed=11,
                        return_logprob=True,
                    ),
                ),
                GenerationItem(
                    "b", [4], SamplingParams(), Bootstrap("127.0.0.1", None, (1 << 63) - 1)
                ),
            ),
        ),
        AbortRequest("a"),
        Shutdown(),
        Shutdown("the HTTP server exited"),
        Ready(
            EngineInfo(
                4096, 131072, {"model_path": "m", "is_generation": True}, "bfloat16", 7, 29500
            )
        ),
        Ready(EngineInfo(256, 4096, {})),
        StartFailed("--model-path x: no config.json"),
        Added(3),
        Added(4, "the prompt is empty", 400),
        Added(5, "internal error: KeyError: 'x'", 500),
        Progress(
            (_output(True), _output(False)),
            {"num_running": 1, "kv_usage": 0.25, "check_error": None},
        ),
        Progress(),
        Fatal("pipeline stage 1 (pid 9) exited with code -9"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_message_survives_the_wire(msg):
    got = decode(encode(msg))
    # tuples of top logprobs come back as lists, which is how they are read
    if isinstance(msg, Progress):
        assert [
            o.logprobs.meta_info(o.output_ids) if o.logprobs else None for o in got.outputs
        ] == [o.logprobs.meta_info(o.output_ids) if o.logprobs else None for o in msg.outputs]
        assert [
            (o.rid, o.new_ids, o.finish_reason, o.text, o.spec_accept_length) for o in got.outputs
        ] == [
            (o.rid, o.new_ids, o.finish_reason, o.text, o.spec_accept_length) for o in msg.outputs
        ]
        assert got.stats == msg.stats
    else:
        assert got == msg


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        msgpack.packb(["Nope", 1]),
        msgpack.packb(["AddItems", "x", []]),
        # max_new_tokens -1: params refuse it
        msgpack.packb(["AddItems", 1, [["a", [1], [-1] + [0] * 17, None]]]),
        msgpack.packb(["Progress", [["r", [], [], True]], {}]),
        msgpack.packb(["Ready", [1]]),
        msgpack.packb(5),
    ],
)
def test_a_bad_frame_is_a_message_error(frame):
    with pytest.raises(MessageError):
        decode(frame)


def test_framed_messages_come_back_whatever_pieces_the_stream_cuts():
    msgs = [
        Added(1),
        Progress((_output(False),), {"num_running": 1}),
        Fatal("x" * 70_000),
        Progress(),
        Shutdown(),
    ]
    frames = [encode(m) for m in msgs]
    stream = b"".join(framed(m) for m in msgs)
    for cut in (1, 3, 4, 5, 17, 4096, len(stream)):
        reader, got = FrameReader(), []
        for i in range(0, len(stream), cut):
            got += reader.feed(stream[i : i + cut])
        assert got == frames, cut
    reader = FrameReader()
    assert reader.feed(stream[:-1]) == frames[:-1]
    assert reader.feed(b"") == [] and reader.feed(stream[-1:]) == frames[-1:]


def _params_with(**bad) -> list:
    """SamplingParams' fields as the wire carries them, with some replaced by bad values."""
    names = [f.name for f in fields(SamplingParams)]
    values = list(astuple(SamplingParams(temperature=2.0)))
    for name, value in bad.items():
        values[names.index(name)] = value
    return values


@pytest.mark.parametrize(
    "head,needle",
    [
        (
            {
                "type": "AddItems",
                "batch": 1,
                "items": [["a", [1, "2"], list(astuple(SamplingParams())), None]],
            },
            "prompt_ids must be a list",
        ),
        ({"type": "AddItems", "batch": -1, "items": []}, "batch must be an int"),
        (
            {
                "type": "AddItems",
                "batch": 1,
                "items": [["a", [1], _params_with(logprob_start_len="x"), None]],
            },
            "not a SamplingParams",
        ),
        (
            {
                "type": "AddItems",
                "batch": 1,
                "items": [["a", [1], _params_with(json_schema=5), None]],
            },
            "`json_schema` must be a string",
        ),
        (
            {"type": "Added", "batch": 1, "error": None, "status": 200},
            "status must be an int in 400..599",
        ),
        (
            {
                "type": "Progress",
                "outputs": [["r", [1], [1], True, None, 1, "", 0, None, [1, 2, 3], 0, 0]],
                "stats": {},
            },
            "logprobs",
        ),
        ({"type": "Progress", "outputs": [], "stats": [1]}, "stats must be a map"),
    ],
)
def test_every_field_is_checked_on_receipt(head, needle):
    """The codec's rules (sparkrelay/codec.py) name the field a frame got wrong."""
    with pytest.raises(MessageError, match=needle):
        decode(msgpack.packb(head))
