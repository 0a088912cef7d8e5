"""The DSpark PD knobs and the SGLang flags, in process:
SPARKRELAY_/SGLANG_DSPARK_PD_TARGET_LAYER_IDS parsing (errors name the variable the user set), one
resolution of the taps for the handshake record and the stages' capture, the tail length bounded by
the context, an explicit --dspark-pd-handoff without taps refused, SPARKRELAY_/SGLANG_HOST_IP (an
address or host name, never a wildcard), and the radix-cache and SGLang-only flags of the command
line."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from sparkrelay.config import Config, ConfigError, add_cli_args, config_from_args
from sparkrelay.disagg.handoff import HandoffError, build_schema, inject_context
from sparkrelay.disagg.metadata import MetadataRow, build_tail
from sparkrelay.disagg.schema import SCHEMA_VERSION, HandoffSchema
from sparkrelay.envs import ENV_VARS, DisaggEnv, env_help
from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.pipeline.capture import CaptureSpec

IDS, SG_IDS = "SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS", "SGLANG_DSPARK_PD_TARGET_LAYER_IDS"
TAIL, SG_TAIL = "SPARKRELAY_DSPARK_PD_PREFILL_TAIL_TOKENS", "SGLANG_DSPARK_PD_PREFILL_TAIL_TOKENS"
CAPTURE = "SPARKRELAY_DSPARK_PD_ENABLE_PREFILL_CAPTURE"
HOST_IP, SG_HOST_IP = "SPARKRELAY_HOST_IP", "SGLANG_HOST_IP"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (
        IDS,
        SG_IDS,
        TAIL,
        SG_TAIL,
        CAPTURE,
        "SGLANG_DSPARK_PD_ENABLE_PREFILL_CAPTURE",
        HOST_IP,
        SG_HOST_IP,
    ):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- *_TARGET_LAYER_IDS parsing


@pytest.mark.parametrize(
    "value,ids", [("1,3,5", (1, 3, 5)), (" 1 , 3,5 ", (1, 3, 5)), ("-1,3", (-1, 3)), ("6", (6,))]
)
def test_layer_ids_split_on_commas_items_stripped(monkeypatch, value, ids):
    monkeypatch.setenv(SG_IDS, value)
    assert DisaggEnv.read().target_layer_ids == ids


@pytest.mark.parametrize(
    "value,says",
    [
        (
            "1 3 5",
            "not an integer (separate the items with commas, not spaces)",
        ),  # read as 135 once
        (",", "has an empty item"),
        ("1,,3", "has an empty item"),
        ("1,3,", "has an empty item"),
        ("", "is empty"),
        ("  ", "is empty"),
        ("1,x", "'x' is not an integer"),
        ("1.5", "'1.5' is not an integer"),
        ("1_0", "'1_0' is not an integer"),  # int() would read 10
        ("+3", "'+3' is not an integer"),
    ],
)
@pytest.mark.parametrize("var", [IDS, SG_IDS])
def test_bad_layer_ids_name_the_variable_set(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as e:
        DisaggEnv.read()
    assert str(e.value).startswith(f"{var}={value!r}") and says in str(e.value), str(e.value)


def test_sparkrelay_name_wins_over_the_alias(monkeypatch):
    monkeypatch.setenv(SG_IDS, "1 3")  # malformed, but not the one read
    monkeypatch.setenv(IDS, "2,4")
    assert DisaggEnv.read().target_layer_ids == (2, 4)


# ---------------------------------------------------------------- *_HOST_IP


@pytest.mark.parametrize(
    "value,host",
    [
        ("10.0.0.1", "10.0.0.1"),
        (" 10.0.0.1 ", "10.0.0.1"),
        ("fd00::1", "fd00::1"),
        ("[fd00::1]", "fd00::1"),  # brackets dropped: they are added where a URL needs them
        ("prefill-a.example.com", "prefill-a.example.com"),
        ("localhost", "localhost"),  # one host, said explicitly
    ],
)
@pytest.mark.parametrize("var", [HOST_IP, SG_HOST_IP])
def test_host_ip_is_an_address_or_a_host_name(monkeypatch, var, value, host):
    monkeypatch.setenv(var, value)
    assert DisaggEnv.read().host_ip == host


def test_host_ip_unset_and_which_name_wins(monkeypatch):
    assert DisaggEnv.read().host_ip is None
    monkeypatch.setenv(SG_HOST_IP, "")  # blank reads as unset
    assert DisaggEnv.read().host_ip is None
    monkeypatch.setenv(SG_HOST_IP, "0.0.0.0")  # malformed, but not the one read
    monkeypatch.setenv(HOST_IP, "10.0.0.2")
    assert DisaggEnv.read().host_ip == "10.0.0.2"
    assert HOST_IP in ENV_VARS and f"{HOST_IP}, {SG_HOST_IP} (default unset)" in env_help()


@pytest.mark.parametrize(
    "value,says",
    [
        ("0.0.0.0", "is a wildcard address"),
        ("::", "is a wildcard address"),
        ("[::]", "is a wildcard address"),
        ("10.0.0.1:8998", "is not an IP address or host name"),  # a port
        ("http://10.0.0.1", "is not an IP address or host name"),
        ("10.0.0.300", "is not an IP address or host name"),
        ("10.0.0", "is not an IP address or host name"),
        ("prefill_a", "is not an IP address or host name"),
        ("-prefill", "is not an IP address or host name"),
        ("a b", "is not an IP address or host name"),
    ],
)
@pytest.mark.parametrize("var", [HOST_IP, SG_HOST_IP])
def test_bad_host_ip_names_the_variable_set(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as e:
        DisaggEnv.read()
    assert str(e.value).startswith(f"{var}={value!r} {says}"), str(e.value)


# ---------------------------------------------------------------- one resolution: record == capture


def _prefill(**leaves) -> Config:
    return Config().replace(model_path="models/tiny-qwen3", disaggregation_mode="prefill", **leaves)


def _spec() -> DecoderSpec:
    return DecoderSpec.from_hf(json.loads(open("models/tiny-qwen3/config.json").read()))


def _record_and_capture(config: Config) -> tuple:
    schema = build_schema(config, _spec(), torch.float32, DisaggEnv.read())
    return schema, CaptureSpec.from_config(config)


@pytest.mark.parametrize(
    "env,leaves,handoff,mode,ids",
    [
        (
            {},
            {"speculative_draft_model_path": "models/tiny-qwen3-dspark"},
            "hidden",
            "taps",
            (1, 3, 5, 6),
        ),
        ({IDS: "2,4"}, {}, "hidden", "taps", (2, 4)),
        ({SG_IDS: "2,4"}, {"dspark_pd_handoff": "tail"}, "tail", "taps", (2, 4)),
        ({}, {}, "none", "none", ()),  # plain PD: no drafter, no knob, no flag
        (
            {CAPTURE: "0"},
            {"speculative_draft_model_path": "models/tiny-qwen3-dspark"},
            "none",
            "none",
            (),
        ),
        (
            {},
            {
                "speculative_draft_model_path": "models/tiny-qwen3-dspark",
                "dspark_pd_handoff": "draft-kv",
            },
            "draft-kv",
            "partial",
            (1, 3, 5, 6),
        ),
    ],
)
def test_record_and_capture_resolve_alike(monkeypatch, env, leaves, handoff, mode, ids):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    schema, capture = _record_and_capture(_prefill(**leaves))
    assert (schema.handoff, schema.target_layer_ids) == (handoff, ids)
    assert (capture.mode, capture.target_layer_ids) == (mode, ids)


def test_capture_off_is_not_ignored_in_draft_kv(monkeypatch):
    """SPARKRELAY_DSPARK_PD_ENABLE_PREFILL_CAPTURE=0 turns draft-kv's capture off too; with the mode
    given on the command line that is a contradiction, refused by name (never a record saying none
    over a capturing pipeline)."""
    monkeypatch.setenv("SGLANG_DSPARK_PD_ENABLE_PREFILL_CAPTURE", "0")
    config = _prefill(
        speculative_draft_model_path="models/tiny-qwen3-dspark", dspark_pd_handoff="draft-kv"
    )
    for resolve in (
        lambda: build_schema(config, _spec(), torch.float32, DisaggEnv.read()),
        lambda: CaptureSpec.from_config(config),
    ):
        with pytest.raises(ConfigError, match="SGLANG_DSPARK_PD_ENABLE_PREFILL_CAPTURE=0 turns"):
            resolve()


@pytest.mark.parametrize("var", [IDS, SG_IDS])
def test_layer_ids_out_of_order_or_range_name_the_variable(monkeypatch, var):
    monkeypatch.setenv(var, "5,3")
    with pytest.raises(ConfigError, match=f"{var}: .*must increase"):
        _record_and_capture(_prefill())
    monkeypatch.setenv(var, "1,9")
    with pytest.raises(ConfigError, match=f"^{var}: "):
        _record_and_capture(_prefill())


def test_draft_kv_knob_must_match_the_drafter(monkeypatch):
    monkeypatch.setenv(SG_IDS, "1,3")
    config = _prefill(
        speculative_draft_model_path="models/tiny-qwen3-dspark", dspark_pd_handoff="draft-kv"
    )
    with pytest.raises(
        ConfigError, match=r"SGLANG_DSPARK_PD_TARGET_LAYER_IDS=1,3 != the drafter's"
    ):
        CaptureSpec.from_config(config)


# ---------------------------------------------------------------- explicit --dspark-pd-handoff
# without taps


@pytest.mark.parametrize("mode", ["tail", "hidden", "draft-kv"])
def test_explicit_handoff_without_taps_is_refused(mode):
    with pytest.raises(ConfigError) as e:
        _record_and_capture(_prefill(dspark_pd_handoff=mode))
    msg = str(e.value)
    assert (
        msg.startswith(f"--dspark-pd-handoff {mode}: the prefill has no DSpark taps")
        and "--speculative-draft-model-path" in msg
    ), msg
    # draft-kv needs the drafter's weights
    assert (IDS in msg and SG_IDS in msg) == (mode != "draft-kv"), msg


def test_left_out_handoff_is_hidden_and_tells_itself_apart():
    assert Config().disagg.dspark_pd_handoff is None and Config().disagg.handoff == "hidden"
    assert _prefill(dspark_pd_handoff="hidden").disagg.handoff == "hidden"


# ---------------------------------------------------------------- *_PREFILL_TAIL_TOKENS


@pytest.mark.parametrize("var", [TAIL, SG_TAIL])
def test_tail_is_bounded_by_the_context_length(monkeypatch, var):
    config = _prefill(
        speculative_draft_model_path="models/tiny-qwen3-dspark", dspark_pd_handoff="tail"
    )
    monkeypatch.setenv(var, "4097")  # the model's max_position_embeddings is 4096
    with pytest.raises(ConfigError, match=f"^{var}=4097 exceeds the context length 4096"):
        build_schema(config, _spec(), torch.float32, DisaggEnv.read())
    monkeypatch.setenv(var, "65")
    with pytest.raises(ConfigError, match=f"^{var}=65 exceeds the context length 64"):
        build_schema(config.replace(context_length=64), _spec(), torch.float32, DisaggEnv.read())
    monkeypatch.setenv(var, "64")
    assert (
        build_schema(
            config.replace(context_length=64), _spec(), torch.float32, DisaggEnv.read()
        ).tail_tokens
        == 64
    )


def test_tail_last_row_field_is_checked_by_the_decode():
    """The metadata row's last_hidden is the tail's last row: the decode refuses a row where they
    differ."""
    w, n = 2 * 16, 12
    schema = HandoffSchema(
        SCHEMA_VERSION,
        "zmq",
        "m",
        "float32",
        "unquant",
        16,
        8,
        2,
        4,
        16,
        ((0, 8),),
        (1, 3),
        w,
        "tail",
        8,
        "off",
        None,
        128,
    )
    rows = torch.randn(n, w)
    tail, valid = build_tail(rows, 8)
    written = []

    class Proposer:
        def write_features(self, features, positions, slots):
            written.append(positions.tolist())

    assert (
        inject_context(
            Proposer(), schema, {0: {}}, MetadataRow(1, 9, rows[-1], tail, valid), torch.arange(n)
        )
        == 4
    )
    assert written == [list(range(4, 12))]
    with pytest.raises(HandoffError, match="last_hidden is not the tail's last row"):
        inject_context(
            Proposer(), schema, {0: {}}, MetadataRow(1, 9, rows[-2], tail, valid), torch.arange(n)
        )


# ---------------------------------------------------------------- the command line


def _parse(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_cli_args(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_prefix_cache_is_on_unless_disable_radix_cache():
    assert _parse(["--model-path", "models/tiny-qwen3"]).cache.disable_radix_cache is False
    config = _parse(["--model-path", "models/tiny-qwen3", "--disable-radix-cache"])
    assert config.cache.disable_radix_cache is True and config.flat()["disable_radix_cache"] is True
    with pytest.raises(ConfigError, match="on by default; --disable-radix-cache turns it off"):
        _parse(["--model-path", "models/tiny-qwen3", "--enable-radix-cache"])


def test_enable_metrics_is_accepted_and_always_in_force():
    """SGLang needs --enable-metrics for /metrics; sparkrelay always serves it, so a copied command
    still starts."""
    assert (
        _parse(["--model-path", "models/tiny-qwen3", "--enable-metrics"]).server.enable_metrics
        is True
    )
    assert _parse(["--model-path", "models/tiny-qwen3"]).server.enable_metrics is True
    with pytest.raises(ConfigError, match="always served"):
        Config().replace(enable_metrics=False).validate()


def test_sglang_only_flags_are_named_together():
    with pytest.raises(ConfigError) as e:
        _parse(["--enable-dp-attention", "--tp-size", "2", "--mem-fraction-static", "0.8"])
    assert str(e.value).startswith(
        "--enable-dp-attention, --tp-size, --mem-fraction-static are SGLang flags "
        "sparkrelay does not implement; remove them"
    ), str(e.value)
    with pytest.raises(ConfigError) as e:
        _parse(["--enable-radix-cache"])
    assert "--enable-radix-cache is an SGLang flag" in str(e.value) and "on by default" in str(
        e.value
    )


def test_a_typo_is_not_an_sglang_flag(capsys):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--page-sise", "16"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --page-sise" in err and "SGLang" not in err, err
