"""The DSpark drafter: checkpoint layout (docs/dspark.md §1.3), loading checks, validation,
embedding sharing, and the forward against a dense reference of §1.5 / §1.6 written here."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sparkrelay.models import cpu_kernels
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import DecoderSpec, load_causal_lm
from sparkrelay.models.dspark import DSparkSpec
from sparkrelay.models.dspark_checkpoint import draft_config, load_dspark, write_random_checkpoint
from sparkrelay.models.loader import CheckpointError, read_config
from testkit.models import make_random_qwen3

torch.set_num_threads(1)

LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
TOP = ["embed_tokens.weight", "norm.weight", "fc.weight", "hidden_norm.weight", "lm_head.weight"]
MARKOV = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
CONFIDENCE = ["confidence_head.proj.weight", "confidence_head.proj.bias"]
VARIANTS = {
    "vanilla": (dict(markov_head_type="vanilla"), MARKOV + CONFIDENCE),
    "gated": (
        dict(markov_head_type="gated"),
        MARKOV + ["markov_head.gate_proj.weight", "markov_head.gate_proj.bias"] + CONFIDENCE,
    ),
    "rnn": (
        dict(markov_head_type="rnn"),
        MARKOV + ["markov_head.joint_proj.weight", "markov_head.joint_proj.bias"] + CONFIDENCE,
    ),
    "dflash": (dict(markov_rank=0, enable_confidence_head=False), []),
}
D, V, R, HD, NKV, NH = (
    64,
    4096,
    32,
    32,
    2,
    4,
)  # the random target of testkit.models.make_random_qwen3; markov_rank 32 (draft_config default)
TAPS = [-1, 0, 2]  # the target has 4 layers: 3 (the last) is never a tap


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_random_qwen3(tmp_path_factory.mktemp("dspark_target"), seed=3)


@pytest.fixture(scope="module")
def target_spec(target_dir):
    return DecoderSpec.from_hf(read_config(target_dir))


def write(tmp_path, target_dir, variant, **kw):
    fields, _ = VARIANTS[variant]
    return write_random_checkpoint(
        tmp_path / variant, target_dir, target_layer_ids=TAPS, **fields, **kw
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_keys_and_shapes(tmp_path, target_dir, variant):
    folder = write(tmp_path, target_dir, variant)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = TOP + [f"layers.{i}.{k}" for i in range(2) for k in LAYER] + VARIANTS[variant][1]
    assert sorted(shapes) == sorted(expected)
    assert shapes["fc.weight"] == (D, 3 * D) and shapes["embed_tokens.weight"] == shapes[
        "lm_head.weight"
    ] == (V, D)
    assert shapes["layers.1.self_attn.k_proj.weight"] == (NKV * HD, D)
    extra = {
        "vanilla": {},
        "dflash": {},
        "gated": {"markov_head.gate_proj.weight": (R, D + R), "markov_head.gate_proj.bias": (R,)},
        "rnn": {
            "markov_head.joint_proj.weight": (3 * R, 2 * R + D),
            "markov_head.joint_proj.bias": (3 * R,),
        },
    }
    for key, shape in extra[variant].items():
        assert shapes[key] == shape
    if variant != "dflash":
        assert (
            shapes["markov_head.markov_w1.weight"]
            == shapes["markov_head.markov_w2.weight"]
            == (V, R)
        )
        assert shapes["confidence_head.proj.weight"] == (1, D + R)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["tie_word_embeddings"] is False
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["num_target_layers"] == 4
    for field in (
        "block_size",
        "target_layer_ids",
        "mask_token_id",
        "markov_rank",
        "enable_confidence_head",
        "num_anchors",
    ):
        assert field in cfg
    assert ("markov_head_type" in cfg) == (variant != "dflash")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_load_round_trip(tmp_path, target_dir, target_spec, variant):
    folder = write(tmp_path, target_dir, variant)
    model = load_dspark(folder, target_spec, fuse=False)
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    assert sorted(state) == sorted(saved)
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor.float()), key
    assert model.spec.markov_head_type == (None if variant == "dflash" else variant)


def test_completeness_errors(tmp_path, target_dir, target_spec):
    folder = write(tmp_path, target_dir, "vanilla")
    path = folder / "model.safetensors"
    good = load_file(str(path))
    cases = {
        "missing tensors: fc.weight": {k: v for k, v in good.items() if k != "fc.weight"},
        "unexpected tensors: markov_head.gate_proj.weight": {
            **good,
            "markov_head.gate_proj.weight": torch.zeros(R, D + R),
        },
        "shape mismatch: hidden_norm.weight (65,)": {**good, "hidden_norm.weight": torch.ones(65)},
    }
    for message, tensors in cases.items():
        save_file(tensors, str(path))
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_dspark(folder, target_spec)
    save_file(good, str(path))
    cfg = read_config(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(CheckpointError, match="Qwen3ForCausalLM"):
        load_dspark(folder, target_spec)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("target_layer_ids", [0, 5], ["target_layer_ids", "[0, 5]", "[5]"]),
        ("target_layer_ids", [-2, 1], ["target_layer_ids", "[-2]"]),
        ("target_layer_ids", [1, 3], ["target_layer_ids", "3", "last layer"]),
        ("target_layer_ids", [2, 1], ["target_layer_ids", "[2, 1]", "strictly increasing"]),
        ("target_layer_ids", [1, 1], ["target_layer_ids", "[1, 1]", "strictly increasing"]),
        ("num_target_layers", 5, ["num_target_layers", "5", "4"]),
        ("hidden_size", 128, ["hidden_size", "128", "64"]),
        ("num_attention_heads", 2, ["num_heads", "2", "4"]),
        ("num_key_value_heads", 1, ["num_kv_heads", "1", "2"]),
        ("head_dim", 16, ["head_dim", "16", "32"]),
        ("vocab_size", 5000, ["vocab_size", "5000", "4096"]),
        ("mask_token_id", 4096, ["mask_token_id", "4096"]),
        ("markov_head_type", "lstm", ["markov_head_type", "lstm"]),
    ],
)
def test_validation_errors_name_field_and_value(target_dir, target_spec, field, value, words):
    cfg = draft_config(read_config(target_dir), target_layer_ids=TAPS)
    cfg[field] = value
    with pytest.raises(ValueError) as err:
        DSparkSpec.from_hf(cfg, target_spec)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_shares_identical_embedding_and_lm_head(tmp_path, target_spec, target_dir):
    tied = make_random_qwen3(tmp_path / "tied", seed=5, tie_word_embeddings=True)
    target = load_causal_lm(str(tied), dtype=torch.bfloat16)
    emb = target.model.embed_tokens.weight
    assert target.lm_head.weight is emb
    folder = write_random_checkpoint(tmp_path / "d", tied, target_layer_ids=TAPS)
    model = load_dspark(
        folder,
        target.spec,
        torch.bfloat16,
        share_embedding_from=emb,
        share_lm_head_from=target.lm_head.weight,
    )
    assert model.embed_tokens.weight is emb and model.lm_head.weight is emb
    assert model.shared_with_target == ("embed_tokens", "lm_head")
    assert emb.requires_grad  # the target's own parameter is left as it was
    # untied fp32 target: both shared; a different target's tensors are not
    untied = load_causal_lm(str(target_dir))
    folder = write_random_checkpoint(
        tmp_path / "f", target_dir, weight_dtype=torch.float32, target_layer_ids=TAPS
    )
    model = load_dspark(
        folder,
        target_spec,
        share_embedding_from=untied.model.embed_tokens.weight,
        share_lm_head_from=untied.lm_head.weight,
    )
    assert (
        model.embed_tokens.weight is untied.model.embed_tokens.weight
        and model.lm_head.weight is untied.lm_head.weight
    )
    other = load_causal_lm(str(tied))
    model = load_dspark(folder, target_spec, share_embedding_from=other.model.embed_tokens.weight)
    assert (
        model.shared_with_target == ()
        and model.embed_tokens.weight is not other.model.embed_tokens.weight
    )


# ----- dense reference of docs/dspark.md §1.4-1.5, written independently of the model code -----


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):  # x [T, H, hd], HF rotate_half form
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    f = torch.outer(pos.float(), inv)
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def dense_block(sd, n_layers, theta, feats, ctx_pos, block_ids, block_pos):
    """One request: context features [Lc, n_taps*d] at ctx_pos, block [B] at block_pos -> h [B, d]; no mask."""
    c = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = sd["embed_tokens.weight"][block_ids]
    pos = torch.cat([ctx_pos, block_pos])
    for i in range(n_layers):
        p = lambda k: sd[f"layers.{i}.{k}"]
        hn = rms(x, p("input_layernorm.weight"))
        q = rope(
            rms(
                (hn @ p("self_attn.q_proj.weight").T).view(-1, NH, HD), p("self_attn.q_norm.weight")
            ),
            block_pos,
            theta,
        )
        kv_in = torch.cat([c, hn])
        k = rope(
            rms(
                (kv_in @ p("self_attn.k_proj.weight").T).view(-1, NKV, HD),
                p("self_attn.k_norm.weight"),
            ),
            pos,
            theta,
        )
        v = (kv_in @ p("self_attn.v_proj.weight").T).view(-1, NKV, HD)
        k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)  # GQA
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD), -1)
        x = (
            x
            + torch.einsum("hqk,khd->qhd", att, v).reshape(len(block_ids), NH * HD)
            @ p("self_attn.o_proj.weight").T
        )
        hn = rms(x, p("post_attention_layernorm.weight"))
        mlp = torch.nn.functional.silu(hn @ p("mlp.gate_proj.weight").T) * (
            hn @ p("mlp.up_proj.weight").T
        )
        x = x + mlp @ p("mlp.down_proj.weight").T
    return rms(x, sd["norm.weight"])


def run_block(model, feats, positions, block_ids, block_pos, ctx_len):
    """Batched: feats [R, Lc, n_taps*d] padded, positions [R, Lc] -> h [R, B, d]."""
    r, lc = feats.shape[:2]
    kv = model.context_kv(model.project_context(feats.reshape(r * lc, -1)), positions.reshape(-1))
    ks = [k.view(r, lc, NKV, HD) for k, _ in kv]
    vs = [v.view(r, lc, NKV, HD) for _, v in kv]
    return model.block_forward(block_ids, block_pos, ks, vs, ctx_len)


@torch.no_grad()
def test_block_forward_matches_dense_reference_and_batching(tmp_path, target_dir, target_spec):
    folder = write(tmp_path, target_dir, "vanilla", weight_dtype=torch.float32)
    plain = load_dspark(folder, target_spec, fuse=False)
    fused = load_dspark(folder, target_spec)
    sd, theta, mask = plain.state_dict(), target_spec.rope_theta, plain.spec.mask_token_id
    gen = torch.Generator().manual_seed(0)
    lens, outs = [5, 9], []
    feats = [torch.randn(n, 3 * D, generator=gen) for n in lens]
    blocks = [torch.tensor([7 + n] + [mask] * 6) for n in lens]
    for f, n, b in zip(feats, lens, blocks):
        ref = dense_block(sd, 2, theta, f, torch.arange(n), b, torch.arange(n, n + 7))
        for model in (plain, fused):
            h = run_block(
                model,
                f[None],
                torch.arange(n)[None],
                b[None],
                torch.arange(n, n + 7)[None],
                torch.tensor([n]),
            )
            torch.testing.assert_close(h[0], ref, atol=2e-5, rtol=1e-5)
        outs.append(ref)
    # padded batch: request 0's context rows 5..8 are garbage and must be masked out
    padded = torch.stack(
        [torch.cat([feats[0], 100 * torch.randn(4, 3 * D, generator=gen)]), feats[1]]
    )
    positions = torch.arange(9).repeat(2, 1)
    block_pos = torch.stack([torch.arange(n, n + 7) for n in lens])
    h = run_block(fused, padded, positions, torch.stack(blocks), block_pos, torch.tensor(lens))
    torch.testing.assert_close(h, torch.stack(outs), atol=2e-5, rtol=1e-5)


def run_block_paged(model, feats, positions, block_ids, block_pos, ctx_len):
    """run_block through the serving path: the context K/V written to scattered pool slots (in reverse
    order, so no row reads a consecutive range), the block's K/V to scratch slots past them."""
    r, lc = feats.shape[:2]
    b, n = block_ids.shape[1], r * lc
    kv = model.context_kv(model.project_context(feats.reshape(n, -1)), positions.reshape(-1))
    ctx_slots = torch.arange(n - 1, -1, -1).view(r, lc)  # [R, Lc]
    pools = []
    for k, v in kv:
        k_pool, v_pool = k.new_zeros(n + r * b, NKV, HD), v.new_zeros(n + r * b, NKV, HD)
        k_pool.index_copy_(0, ctx_slots.reshape(-1), k)
        v_pool.index_copy_(0, ctx_slots.reshape(-1), v)
        pools.append((k_pool, v_pool))
    scratch = torch.arange(n, n + r * b).view(r, b)
    meta = AttnMeta.draft_block(ctx_slots, ctx_len, scratch, block_pos)
    return model.block_forward_paged(block_ids, block_pos, pools, meta)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_block_forward_equals_gathered(tmp_path, target_dir, target_spec, dtype):
    """The serving block forward (paged attention over scattered context slots and scratch block slots;
    in bf16 the decode-attention kernel where it is built) equals the training one, ragged contexts
    included."""
    if dtype == torch.bfloat16 and cpu_kernels.load() is None:
        pytest.skip("the CPU kernels are not built: bf16 would take the same SDPA path as float32")
    folder = write(tmp_path, target_dir, "vanilla", weight_dtype=torch.float32)
    model = load_dspark(folder, target_spec, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    lens, mask = torch.tensor([5, 9, 9]), model.spec.mask_token_id
    feats = torch.randn(3, 9, 3 * D, generator=gen).to(dtype)
    blocks = torch.tensor([[7 + int(n)] + [mask] * 6 for n in lens])
    block_pos = torch.stack([torch.arange(n, n + 7) for n in lens.tolist()])
    args = (feats, torch.arange(9).repeat(3, 1), blocks, block_pos, lens)
    want, got = run_block(model, *args), run_block_paged(model, *args)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # one row alone (no padding, no mask) gives its row of the batch
    one = run_block_paged(model, *(a[1:2] for a in args))
    torch.testing.assert_close(one[0].float(), got[1].float(), **tol)


def markov_reference(sd, kind, u, h, anchors):
    """Greedy §2.2 step 4 with the §1.6 heads, one request at a time."""
    w1, w2 = sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"]
    drafts, zs = [], []
    for r in range(u.shape[0]):
        prev, s = int(anchors[r]), torch.zeros(w1.shape[1])
        for k in range(u.shape[1]):
            e = w1[prev]
            if kind == "gated":
                e = (
                    torch.sigmoid(
                        sd["markov_head.gate_proj.weight"] @ torch.cat([h[r, k], e])
                        + sd["markov_head.gate_proj.bias"]
                    )
                    * e
                )
            elif kind == "rnn":
                j = (
                    sd["markov_head.joint_proj.weight"] @ torch.cat([s, e, h[r, k]])
                    + sd["markov_head.joint_proj.bias"]
                )
                g, c, o = j.chunk(3)
                s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
                e = torch.tanh(o)
            z = u[r, k] + w2 @ e
            prev = int(z.argmax())
            drafts.append(prev)
            zs.append(z)
    return torch.tensor(drafts).view(u.shape[:2]), torch.stack(zs).view(u.shape)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_greedy_is_sequential_argmax(tmp_path, target_dir, target_spec, kind):
    folder = write(tmp_path, target_dir, kind, weight_dtype=torch.float32)
    model = load_dspark(folder, target_spec)
    # checkpoint names: the fused W2 is packed
    sd = load_dspark(folder, target_spec, fuse=False).state_dict()
    gen = torch.Generator().manual_seed(1)
    u, h = torch.randn(3, 7, V, generator=gen), torch.randn(3, 7, D, generator=gen)
    anchors = torch.tensor([5, 900, 4000])
    drafts, z = model.markov_sample(
        u, anchors, torch.zeros(3), torch.ones(3, dtype=torch.bool), h=h
    )
    ref_d, ref_z = markov_reference(sd, kind, u, h, anchors)
    assert torch.equal(drafts, ref_d)
    torch.testing.assert_close(z, ref_z, atol=1e-4, rtol=1e-5)
    prev = torch.cat([anchors[:, None], drafts[:, :-1]], 1)
    # training path == sampling path
    torch.testing.assert_close(u + model.markov_bias(h, prev), z, atol=1e-4, rtol=1e-5)
    conf = (
        torch.cat([h, sd["markov_head.markov_w1.weight"][prev]], -1)
        @ sd["confidence_head.proj.weight"][0]
    )
    torch.testing.assert_close(
        model.confidence(h, prev), conf + sd["confidence_head.proj.bias"], atol=1e-5, rtol=1e-5
    )
    # sampling: a row's own generator makes its draws reproducible; a near-zero temperature is
    # greedy
    mixed = torch.tensor([False, True, False])
    temps = torch.tensor([1.0, 0.0, 1e-6])
    a = model.markov_sample(
        u, anchors, temps, mixed, h=h, generators=[torch.Generator().manual_seed(9), None, None]
    )[0]
    b = model.markov_sample(
        u, anchors, temps, mixed, h=h, generators=[torch.Generator().manual_seed(9), None, None]
    )[0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1:], ref_d[1:])


@torch.no_grad()
@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_markov_bf16_sums_in_float32(tmp_path, target_dir, target_spec, kind):
    """A bf16 drafter: Z_k = U_k + W2 m_k summed in float32 from its bf16 operands (one kernel pass where
    the CPU kernels are built), every row's slots written in place; drafts the argmax of each slot."""
    folder = write(tmp_path, target_dir, kind, weight_dtype=torch.float32)
    model = load_dspark(folder, target_spec, dtype=torch.bfloat16)
    sd = load_dspark(folder, target_spec, dtype=torch.bfloat16, fuse=False).state_dict()
    gen = torch.Generator().manual_seed(2)
    u = (3 * torch.randn(3, 7, V, generator=gen)).to(torch.bfloat16)
    h = torch.randn(3, 7, D, generator=gen).to(torch.bfloat16)
    anchors = torch.tensor([5, 900, 4000])
    drafts, z = model.markov_sample(
        u, anchors, torch.zeros(3), torch.ones(3, dtype=torch.bool), h=h
    )
    prev = torch.cat([anchors[:, None], drafts[:, :-1]], 1)
    state, ms = None, []
    for k in range(7):  # m_k of the head's own state machine (vanilla: W1[prev])
        mk, state = model.markov_head.mix(h[:, k], prev[:, k], state)
        ms.append(mk)
    ref = u.float() + torch.stack(ms, 1).float() @ sd["markov_head.markov_w2.weight"].float().t()
    torch.testing.assert_close(z, ref, atol=2e-4, rtol=1e-5)
    assert z.dtype == torch.float32 and torch.equal(drafts, z.argmax(-1))


@torch.no_grad()
@pytest.mark.skipif(cpu_kernels.portable() is None, reason="the CPU kernels are not built here")
@pytest.mark.parametrize("restricted, int8", [(False, False), (True, False), (True, True)])
def test_markov_greedy_block_in_one_call_equals_the_slot_loop(
    tmp_path, target_dir, target_spec, restricted, int8
):
    """An all-greedy bf16 block on the kernels (the AVX-512 build, or the AVX2 one's bf16 W2) runs as
    one call (csrc/cpu_markov.cpp): drafts and Z bit-equal to markov_sample's slot-by-slot loop,
    over every token and over a draft vocabulary, with W2 in bf16 or int8
    (--speculative-draft-model-quantization int8wo, AVX-512 build only)."""
    from sparkrelay.models.quant import Int8Linear, apply_torchao_config

    if int8 and cpu_kernels.load() is None:
        pytest.skip("the int8 kernel is in the AVX-512 build alone")
    folder = write(tmp_path, target_dir, "vanilla", weight_dtype=torch.float32)
    model = load_dspark(folder, target_spec, dtype=torch.bfloat16)
    if restricted:
        model.restrict_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(4))[:999])
    if int8:
        apply_torchao_config(model, "int8wo", keep=("fc",))
        assert isinstance(model.markov_head.vocab_w2, Int8Linear)
        assert not isinstance(model.fc, Int8Linear)  # fc stays bf16 (as the prefill's sums)
    width = 999 if restricted else V
    gen = torch.Generator().manual_seed(3)
    u = (3 * torch.randn(3, 7, width, generator=gen)).to(torch.bfloat16)
    anchors, greedy = torch.tensor([5, 900, 4000]), torch.ones(3, dtype=torch.bool)
    head, calls = model.markov_head, []
    one_call = head.greedy_block
    head.greedy_block = lambda *a: calls.append(1) or one_call(*a)
    fast = model.markov_sample(u, anchors, torch.zeros(3), greedy, in_vocab=restricted)
    head.greedy_block = lambda *a: None  # the slot loop
    loop = model.markov_sample(u, anchors, torch.zeros(3), greedy, in_vocab=restricted)
    assert calls == [1]
    assert torch.equal(fast[0], loop[0]) and torch.equal(fast[1], loop[1])
    if restricted:  # token ids, not draft-vocabulary columns
        assert bool(torch.isin(fast[0], model.vocab).all())


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_context_kv_equals_the_layer_by_layer_projection(
    tmp_path, target_dir, target_spec, dtype
):
    """ContextKV after freeze (one product for every layer's k and v, one k_norm, one RoPE) gives
    each layer the K/V of that layer's own k_proj, k_norm, RoPE and v_proj (training's path)."""
    folder = write(tmp_path, target_dir, "vanilla", weight_dtype=torch.float32)
    frozen = load_dspark(folder, target_spec, dtype=dtype)
    layered = load_dspark(folder, target_spec, dtype=dtype, fuse=False)
    assert frozen.context.product is not None and layered.context.product is None
    c = torch.randn(5, D, generator=torch.Generator().manual_seed(5)).to(dtype)
    positions = torch.tensor([0, 3, 17, 200, 1000])
    got, ref = frozen.context_kv(c, positions), layered.context_kv(c, positions)
    assert len(got) == len(ref) == frozen.spec.body.num_layers
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for (k, v), (k_ref, v_ref) in zip(got, ref):
        assert k.shape == k_ref.shape and v.shape == v_ref.shape
        torch.testing.assert_close(k.float(), k_ref.float(), **tol)
        torch.testing.assert_close(v.float(), v_ref.float(), **tol)


@torch.no_grad()
def test_dflash_samples_each_slot_independently(tmp_path, target_dir, target_spec):
    model = load_dspark(write(tmp_path, target_dir, "dflash"), target_spec)
    assert model.markov_head is None and model.confidence_head is None
    u = torch.randn(2, 7, V)
    drafts, z = model.markov_sample(
        u, torch.tensor([1, 2]), torch.zeros(2), torch.ones(2, dtype=torch.bool)
    )
    assert torch.equal(drafts, u.argmax(-1)) and torch.equal(z, u)
    with pytest.raises(ValueError, match="confidence"):
        model.confidence(torch.zeros(2, 7, D), drafts)
