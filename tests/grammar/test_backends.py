"""The grammar backends and the bitmask: both backends parse SGLang's three fields and refuse bad
ones with the field's name; the mask kernel equals torch's unpack-and-fill at odd vocabularies and
leaves the raw logits alone; the verify rows' masks follow the drafts and every matcher ends where it
began (grammar/rows.py)."""

from __future__ import annotations

import json

import pytest
import torch

from sparkrelay.grammar import bitmask as bm
from sparkrelay.grammar.backends import BACKENDS, Grammar, GrammarError, backend_class, check
from sparkrelay.grammar.rows import DraftGuide, masks
from sparkrelay.models import cpu_kernels
from sparkrelay.scheduler.request import RequestError, SamplingParams
from testkit.models import BUNDLED

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED))


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    return backend_class(request.param)(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    "kind, text",
    [
        ("json_schema", '{"type": "objec"}'),
        ("json_schema", "{not json"),
        ("regex", "(ab"),
        ("ebnf", "root ::= undefined_rule"),
    ],
)
def test_a_bad_grammar_is_refused_naming_its_field(name, kind, text):
    with pytest.raises(GrammarError, match=f"`{kind}`"):
        check(Grammar(kind, text), name)


@pytest.mark.parametrize("name", BACKENDS)
def test_good_grammars_pass(name):
    for g in (
        Grammar("json_schema", SCHEMA),
        Grammar("regex", "(yes|no)"),
        Grammar("ebnf", 'root ::= "a" "b"*'),
    ):
        check(g, name)


def test_one_grammar_field_at_most():
    with pytest.raises(RequestError, match="at most one of json_schema, regex"):
        SamplingParams(json_schema=SCHEMA, regex="a")
    with pytest.raises(RequestError, match="`regex` must not be empty"):
        SamplingParams(regex="")
    assert SamplingParams(ebnf='root ::= "a"').grammar == ("ebnf", 'root ::= "a"')


def test_matcher_follows_a_valid_answer(backend, tokenizer):
    m = backend.matcher(backend.compile(Grammar("json_schema", SCHEMA)))
    ids = tokenizer.encode('{"n": 42, "ok": true}')
    mask = bm.allowing_all(1, len(tokenizer))
    for t in ids:
        m.fill(mask, 0)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, tokenizer.decode([t])
        assert m.consume(t)
    assert m.finished or m.consume(tokenizer.eos_token_id)
    assert not backend.matcher(backend.compile(Grammar("json_schema", SCHEMA))).consume(
        tokenizer.encode("[")[0]
    )


@pytest.mark.parametrize("vocab", [1, 31, 33, 4099, 49155])
@pytest.mark.parametrize("kernel", [True, False])
def test_constrain_equals_the_reference(vocab, kernel, monkeypatch):
    if kernel and cpu_kernels.portable() is None:
        pytest.skip(f"CPU kernels off: {cpu_kernels.why_off()}")
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "portable", lambda: None)
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (5, bm.words(vocab)), generator=g, dtype=torch.int64)
    mask = words.to(torch.int32)
    raw = logits.clone()
    out = bm.constrain(logits, mask, [0, 2, 3])
    assert torch.equal(logits, raw), "the raw logits were written"
    for r in range(5):
        for t in range(vocab):
            banned = r in (0, 2, 3) and not (int(mask[r, t // 32]) >> (t % 32)) & 1
            assert (out[r, t] == float("-inf")) if banned else (out[r, t] == raw[r, t]), (r, t)


def _fresh_mask(backend, compiled, tokens: list[int], vocab: int) -> torch.Tensor:
    fresh = backend.matcher(compiled)
    for t in tokens:
        assert fresh.consume(t)
    want = bm.allowing_all(1, vocab)
    fresh.fill(want, 0)
    return want[0]


def test_draft_guide_masks_each_slot_and_keeps_them_for_verify(backend, tokenizer):
    """Slot k's logits get the mask after d_1..d_k and so does verify row k; a refused draft leaves
    the request's later rows open; a request without a grammar is left alone; every matcher ends
    where it began."""
    compiled = backend.compile(Grammar("json_schema", SCHEMA))
    m = backend.matcher(compiled)
    head = tokenizer.encode('{"n": ')
    for t in head:
        assert m.consume(t)
    good = tokenizer.encode('42, "ok"')
    drafts = good[:2] + tokenizer.encode("x")[:1] + good[2:3]  # the third is refused
    vocab, slots = len(tokenizer), len(drafts)
    guide = DraftGuide.of([None, m], slots, vocab)
    prev = torch.tensor([0, head[-1]])
    for k in range(slots):
        z = torch.zeros(2, vocab)
        out = guide(k, prev, z)
        assert torch.equal(out[0], torch.zeros(vocab))  # no grammar: untouched
        if k <= 2:  # slots 0..2 follow the accepted drafts; the refused one closes the request
            want = _fresh_mask(backend, compiled, head + drafts[:k], vocab)
            allowed = torch.tensor([(int(want[t // 32]) >> (t % 32)) & 1 for t in range(vocab)])
            assert torch.equal(out[1] == 0, allowed.bool()), k
        else:
            assert torch.equal(out[1], torch.zeros(vocab)), k
        prev = torch.tensor([0, drafts[k]])
    guide.finish(torch.tensor([[0] * slots, drafts]))
    got = guide.verify_masks([2, slots])
    assert got.rows == [3, 4, 5]  # request 1's rows follow request 0's 3; those under its grammar
    for j in range(3):
        assert torch.equal(
            got.bitmask[3 + j], _fresh_mask(backend, compiled, head + drafts[:j], vocab)
        )
    # rows 3 and 4 of request 1 follow the refused draft: open
    assert torch.equal(got.bitmask[6:], bm.allowing_all(2, vocab))
    assert m.consume(good[0]) and m.consume(good[1])  # the matcher is where it was


def _logits(vocab: int, *ranked: int) -> torch.Tensor:
    """float32 [V]: the tokens `ranked` first, in that order, every other token below them."""
    z = torch.zeros(vocab)
    for i, t in enumerate(ranked):
        z[t] = 10.0 - i
    return z


def _eager_argmax(backend, compiled, tokens: list[int], row: torch.Tensor) -> int:
    """The argmax of `row` under the mask after `tokens`: what a fully masked row picks."""
    out = bm.constrain(row[None].clone(), _fresh_mask(backend, compiled, tokens, len(row))[None])
    return int(out[0].argmax())


def test_a_greedy_row_is_masked_only_where_its_argmax_is_refused(backend, tokenizer):
    """A greedy row whose argmax the grammar allows keeps its logits (same object, no mask
    computed); one whose argmax is refused gets the full mask, so the pick is the masked argmax."""
    compiled = backend.compile(Grammar("json_schema", SCHEMA))
    m = backend.matcher(compiled)
    head = tokenizer.encode('{"n": ')
    for t in head:
        assert m.consume(t)
    vocab, four, x = len(tokenizer), tokenizer.encode("4")[0], tokenizer.encode("x")[0]
    allowed = _logits(vocab, four, x)[None]
    got = masks([m], vocab, [True])
    assert got.rows == [] and got.apply(allowed) is allowed
    refused = _logits(vocab, x, four)[None]
    out = masks([m], vocab, [True]).apply(refused)
    assert torch.equal(out[0] == float("-inf"), _fresh_mask_banned(backend, compiled, head, vocab))
    assert int(out[0].argmax()) == four and refused[0, x] == 10.0  # the input is left alone
    assert m.allows([four]) and not m.allows([x])  # and the matcher did not move


def _fresh_mask_banned(backend, compiled, tokens: list[int], vocab: int) -> torch.Tensor:
    want = _fresh_mask(backend, compiled, tokens, vocab)
    return torch.tensor([not (int(want[t // 32]) >> (t % 32)) & 1 for t in range(vocab)])


def test_greedy_verify_rows_settle_to_the_masked_argmax_up_to_the_first_mismatch(
    backend, tokenizer
):
    """A greedy request's drafter slots and verify rows: a slot or row whose argmax is allowed is
    not masked; the first verify row whose argmax is refused gets the mask after its drafts, and
    every row up to the first mismatch picks what the fully masked row picks; rows after it are
    never read (left alone)."""
    compiled = backend.compile(Grammar("json_schema", SCHEMA))
    m = backend.matcher(compiled)
    head = tokenizer.encode('{"n": ')
    for t in head:
        assert m.consume(t)
    drafts = tokenizer.encode('42, "ok"')[:3]
    vocab, slots, x = len(tokenizer), 3, tokenizer.encode("x")[0]
    guide = DraftGuide.of([m], slots, vocab, [True])
    prev = torch.tensor([head[-1]])
    for k in range(slots):  # slot 1's argmax is refused: masked there, its second choice drafted
        z = _logits(vocab, x, drafts[k])[None] if k == 1 else _logits(vocab, drafts[k])[None]
        before = z.clone()
        out = guide(k, prev, z)
        assert torch.equal(out, before) == (k != 1), k
        assert int(out[0].argmax()) == drafts[k]
        prev = torch.tensor([drafts[k]])
    guide.finish(torch.tensor([drafts]))
    seven = tokenizer.encode("7")[0]
    cases = [  # verify rows 0..3 (after the anchor and drafts "4", "2", ",") and the rows masked
        # row 1 refused, its masked argmax "7" is not the draft "2": rows 2 and 3 never read
        ([[drafts[0]], [x, seven], [x], [x]], [1]),
        # every refused row's masked argmax is its draft: the chain goes on to the last row
        ([[drafts[0]], [x, drafts[1]], [x], [x]], [1, 2, 3]),
    ]
    for ranked, masked in cases:
        logits = torch.stack([_logits(vocab, *r) for r in ranked])  # [4, V]
        got = guide.verify_masks([slots], [drafts])
        assert got.rows == []
        out = got.apply(logits)
        for j in range(4):
            if j in masked:
                banned = _fresh_mask_banned(backend, compiled, head + drafts[:j], vocab)
                assert torch.equal(out[j] == float("-inf"), banned), (ranked, j)
            else:
                assert torch.equal(out[j], logits[j]), (ranked, j)
            if j <= max(masked):  # rows up to the first mismatch pick what a masked row picks
                want = _eager_argmax(backend, compiled, head + drafts[:j], logits[j])
                assert int(out[j].argmax()) == want, (ranked, j)
        assert int(out[1].argmax()) == (seven if masked == [1] else drafts[1])
    assert m.allows(drafts) and m.consume(drafts[0])  # the matcher is where it began


def test_descriptor_carries_a_sampling_sequence_mask():
    """A pipeline's last stage samples under the mask rank 0 computed; sequences without a grammar
    cost the wire nothing."""
    from sparkrelay.pipeline.descriptor import SEQ_FIELDS, STEP, MicroBatch, SeqDesc, decode, encode

    words = bm.allowing_all(1, 100)[0]
    words[1] = 5  # tokens 32 and 34 of 32..63
    free = SeqDesc(0, 0, 0, 8, 8, True, [0, 1], SamplingParams(temperature=0.0))
    held = SeqDesc(1, 0, 0, 6, 6, True, [2], SamplingParams(), mask=words.tolist())
    _, body, _ = encode(MicroBatch(STEP, 1, 0, 1, [free], []))
    assert body.numel() == SEQ_FIELDS + 2
    mb = decode(*encode(MicroBatch(STEP, 2, 0, 1, [free, held], [])))
    assert mb.seqs[0].mask == [] and mb.seqs[1].mask == words.tolist()
