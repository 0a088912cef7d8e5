"""One frozen config tree, validated once; the command line is generated from it.

Every leaf field carries its help text in `field(metadata=...)`; `add_cli_args` turns each field of
every section into one `--flag` (SGLang's flag names where they exist), in one --help group per
section (its `title`), with its default; `config_from_args` builds the tree back. Defaults live only
here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


class ConfigError(ValueError):
    """A bad setting, with a message naming the flag."""


def _f(default: Any, help: str, choices: tuple | None = None, ftype: type | None = None) -> Any:
    meta = {"help": help, "choices": choices, "type": ftype}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    model_path: str = _f(
        "models/tiny-qwen3", "Hugging Face folder of the target model, or a .gguf file."
    )
    tokenizer_path: Optional[str] = _f(
        None, "Tokenizer folder or .gguf file (default: --model-path).", ftype=str
    )
    tool_call_parser: Optional[str] = _f(
        None,
        "The format of the model's tool calls (hermes and qwen25 are the same: <tool_call> "
        "JSON </tool_call>); default: read off the chat template, which must then show it.",
        ("hermes", "qwen25"),
        ftype=str,
    )
    chat_template: Optional[str] = _f(
        None,
        "A Jinja chat template file that replaces the tokenizer's own (e.g. "
        "sparkrelay/chat_templates/chatml_tools.jinja, a ChatML template with tool calls).",
        ftype=str,
    )
    dtype: str = _f(
        "auto", "Weight and activation dtype (auto: float32 on cpu, bfloat16 on cuda).", DTYPES
    )
    device: str = _f("cpu", "Torch device: cpu, cuda or cuda:N.")
    torchao_config: str = _f(
        "",
        "int8wo: int8 weights with per-output-channel scales in the target's and drafter's "
        "linears, cpu only (the LM head and embeddings stay in --dtype).",
        ("", "int8wo"),
    )
    load_format: str = _f(
        "auto",
        "Target and drafter weights: auto = a folder's safetensors or a .gguf file, by the "
        "path; safetensors; gguf (the target is a .gguf file, dequantized with the gguf "
        "package into --dtype); or dummy (random, at each config.json's shapes, the same "
        "in every process).",
        LOAD_FORMATS,
    )
    context_length: Optional[int] = _f(
        None, "Longest prompt + output (default: the model's limit).", ftype=int
    )
    served_model_name: Optional[str] = _f(
        None, "Model name reported by the API (default: --model-path).", ftype=str
    )
    seed: int = _f(0, "Seed of the sampling generator used by requests without their own seed.")
    enable_torch_compile: bool = _f(
        False,
        "Compile the target forward (and the drafter's block forward) with "
        "torch.compile (needs a C++ compiler on CPU; the first steps are slow).",
    )


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = _f(16, "Tokens per KV cache page (block).")
    max_total_tokens: Optional[int] = _f(
        None,
        "KV cache capacity in tokens (default: 64 full-context requests, 2^17, "
        "or on cpu what 4 GiB holds, whichever is smallest).",
        ftype=int,
    )
    disable_radix_cache: bool = _f(
        False,
        "Turn the prefix (radix) cache off: every prompt is then prefilled (or, on "
        "a PD decode, received) in full.",
    )


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = _f(64, "Most requests decoding at once.")
    chunked_prefill_size: int = _f(
        2048, "Token budget of one prefill step; longer prompts are prefilled in chunks."
    )
    max_n: int = _f(16, "Largest `n` (parallel samples) one request may ask for.")
    grammar_backend: str = _f(
        "llguidance",
        "Structured outputs (json_schema, regex, ebnf, response_format, tools): the grammar "
        "library that constrains sampling; none refuses such requests.",
        ("llguidance", "xgrammar", "none"),
    )


SPEC_ALGORITHMS = ("DSPARK",)
DRAFT_QUANTIZATIONS = ("unquant", "int8wo")  # SGLang's --speculative-draft-model-quantization


@dataclass(frozen=True)
class SpecConfig:
    speculative_algorithm: Optional[str] = _f(
        None, "Speculative decoding algorithm (DSPARK).", SPEC_ALGORITHMS, str
    )
    speculative_draft_model_path: Optional[str] = _f(
        None, "DeepSpec-format DSpark (or DFlash) drafter folder.", ftype=str
    )
    speculative_num_draft_tokens: Optional[int] = _f(
        None, "Most draft tokens proposed per round (default: the drafter's block_size).", ftype=int
    )
    speculative_dspark_confidence_threshold: float = _f(
        0.0, "Truncate a block at the first slot whose confidence is below this (0 = full blocks)."
    )
    speculative_token_map: Optional[str] = _f(
        None,
        "Draft only among these token ids (FR-Spec's hot tokens; a JSON list): the drafter's LM "
        "head and Markov head cost that share of the vocabulary; still lossless.",
        ftype=str,
    )
    speculative_draft_model_quantization: Optional[str] = _f(
        None,
        "The drafter's linears (and a draft-kv prefill's context projection): int8wo (int8 "
        "weights, per-output-channel scales, cpu) or unquant (--dtype); default: as "
        "--torchao-config. Still lossless: only the target's verification commits tokens.",
        DRAFT_QUANTIZATIONS,
        str,
    )
    speculative_disable_by_batch_size: Optional[int] = _f(
        None,
        "A decode step of at least this many requests runs without drafting (one token each, "
        "the drafter's context still written, so drafting resumes when the batch shrinks), as "
        "vLLM's speculative_disable_by_batch_size: for hosts where verifying many rows costs "
        "more than drafting saves (e.g. bf16 on a CPU without AVX-512 bf16).",
        ftype=int,
    )


@dataclass(frozen=True)
class ParallelConfig:
    pp_size: int = _f(
        1,
        "Pipeline-parallel stages, one process each (ZMQ ipc:// between them, tcp:// between hosts; NCCL with "
        "a GPU each); each owns a "
        "contiguous layer range (pipeline/partition.py).",
    )
    dist_init_port: Optional[int] = _f(
        None,
        "TCP port of the NCCL stages' torch.distributed rendezvous on one host (default: a free port); "
        "it binds 127.0.0.1 only. CPU stages meet over ipc:// files and listen on no TCP port; across "
        "hosts the pipeline meets at --dist-init-addr.",
        ftype=int,
    )
    nnodes: int = _f(
        1,
        "Hosts the pipeline's stages run on: --pp-size / --nnodes stages each, in order (node 0 runs "
        "the HTTP server, the scheduler and stages 0..; node R > 0 runs only its stages).",
    )
    node_rank: int = _f(0, "This host's place among --nnodes (0: the server; R > 0: stages only).")
    dist_init_addr: Optional[str] = _f(
        None,
        "HOST:PORT where node 0 meets the other nodes (HOST: node 0's address, which its pipeline "
        "sockets bind; stage r's inbox listens on PORT + 1 + r of its node when its sender is on "
        "another host). Needed with --nnodes > 1; frames are authenticated with "
        "--disaggregation-auth-token (or SPARKRELAY_DISAGGREGATION_AUTH_TOKEN).",
        ftype=str,
    )
    dist_timeout: float = _f(
        10.0,
        "Seconds without a heartbeat after which a pipeline node is declared lost (--nnodes > 1): "
        "node 0 fails its requests and exits non-zero, node R stops its stages and exits.",
    )

    @property
    def stages_per_node(self) -> int:
        return self.pp_size // self.nnodes

    def node_of(self, rank: int) -> int:
        """The node that runs pipeline stage `rank`: stages are split over nodes in order."""
        return rank // self.stages_per_node

    def init_host_port(self) -> tuple[str, int]:
        """--dist-init-addr as (host, port); an IPv6 host may be given in brackets."""
        addr = self.dist_init_addr or ""
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
        return host.strip("[]"), int(port)


DISAGG_MODES = ("null", "prefill", "decode")
HANDOFF_MODES = ("tail", "hidden", "draft-kv")
DEFAULT_HANDOFF = "hidden"
TRANSFER_BACKENDS = ("zmq", "mooncake", "nixl")


@dataclass(frozen=True)
class DisaggConfig:
    disaggregation_mode: str = _f(
        "null", "PD role: null (aggregated), prefill or decode.", DISAGG_MODES
    )
    disaggregation_bootstrap_port: int = _f(
        8998,
        "Prefill: port of the bootstrap HTTP server. Decode: the port used "
        "when a request's bootstrap_port is null.",
    )
    disaggregation_bootstrap_host: str = _f(
        "127.0.0.1",
        "Prefill: address the bootstrap server and the transfer "
        "sockets bind (reachable at the prefill URL's host).",
    )
    disaggregation_transfer_backend: str = _f(
        "zmq",
        "KV transfer: zmq (ZMQ/TCP), mooncake or nixl (one-sided "
        "writes; extras .[mooncake] / .[nixl]). Same on both servers.",
        TRANSFER_BACKENDS,
    )
    dspark_pd_handoff: Optional[str] = _f(
        None,
        "What carries the DSpark drafter's context from prefill to decode: tail (last rows in the metadata "
        "row), hidden (every prompt row), draft-kv (the drafter's context K/V, projected on prefill) (default: "
        "hidden). Given on a prefill, it needs taps (--speculative-draft-model-path or "
        "SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS); left out, a prefill without taps hands off none.",
        HANDOFF_MODES,
        str,
    )
    disaggregation_auth_token: Optional[str] = _f(
        None,
        "Shared secret of a PD pair; set the same on prefill and decode (default: the env "
        "SPARKRELAY_DISAGGREGATION_AUTH_TOKEN, which keeps it off `ps`). With it the bootstrap server wants "
        "`Authorization: Bearer TOKEN` on every route but GET /health (401 otherwise), and every transfer "
        "message carries an HMAC-SHA256 tag; untagged or forged messages are dropped. A token on one side "
        "only fails each request with the reason. Without one, binding --disaggregation-bootstrap-host to a "
        "non-loopback address logs a warning at start. Use a long random value (secrets.token_urlsafe(32)).",
        ftype=str,
    )

    @property
    def handoff(self) -> str:
        """The handoff mode in force: --dspark-pd-handoff, else hidden (None tells a left-out flag
        from a given one)."""
        return self.dspark_pd_handoff or DEFAULT_HANDOFF


@dataclass(frozen=True)
class ServerConfig:
    host: str = _f("127.0.0.1", "Address the HTTP server binds.")
    port: int = _f(30000, "HTTP port.")
    log_level: str = _f("info", "Logging level.", LOG_LEVELS)
    api_key: Optional[str] = _f(
        None, "Require `Authorization: Bearer KEY` on every API route.", ftype=str
    )
    max_request_body_mb: int = _f(
        64,
        "Largest HTTP request body accepted, in MiB (a larger one gets a 413); the "
        "default fits dozens of 128k-token prompts in one batch.",
    )
    cpu_affinity: str = _f(
        "auto",
        "auto: on an aggregated CPU server without pipeline stages, the engine loop's thread "
        "keeps the first core this server may use and the HTTP process runs on the last one "
        "(host.py); none: the kernel places both.",
        ("auto", "none"),
    )
    enable_metrics: bool = _f(
        True,
        "SGLang's switch, accepted and always in force: /metrics (Prometheus) is always "
        "served (default: true).",
    )


def _section(cls: type, title: str) -> Any:
    return field(default_factory=cls, metadata={"title": title})


@dataclass(frozen=True)
class Config:
    model: ModelConfig = _section(ModelConfig, "model")
    cache: CacheConfig = _section(CacheConfig, "KV cache")
    scheduler: SchedulerConfig = _section(SchedulerConfig, "scheduler")
    spec: SpecConfig = _section(SpecConfig, "speculative decoding (DSpark)")
    parallel: ParallelConfig = _section(ParallelConfig, "pipeline parallelism")
    disagg: DisaggConfig = _section(DisaggConfig, "PD disaggregation")
    server: ServerConfig = _section(ServerConfig, "HTTP server")

    @property
    def draft_torchao_config(self) -> str:
        """The --torchao-config value the drafter's linears take ("" or "int8wo"):
        --speculative-draft-model-quantization, else the target's."""
        q = self.spec.speculative_draft_model_quantization
        return self.model.torchao_config if q is None else ("" if q == "unquant" else q)

    def validate(self) -> "Config":
        _positive("--page-size", self.cache.page_size)
        _positive("--max-running-requests", self.scheduler.max_running_requests)
        _positive("--chunked-prefill-size", self.scheduler.chunked_prefill_size)
        _positive("--max-n", self.scheduler.max_n)
        _positive("--max-request-body-mb", self.server.max_request_body_mb)
        for flag, value in (
            ("--max-total-tokens", self.cache.max_total_tokens),
            ("--context-length", self.model.context_length),
        ):
            if value is not None:
                _positive(flag, value)
        if not (0 < self.server.port < 65536):
            raise ConfigError(f"--port must be in 1..65535, got {self.server.port}")
        if not self.server.enable_metrics:
            raise ConfigError("enable_metrics: /metrics is always served; it cannot be turned off")
        self._validate_spec()
        self._validate_parallel()
        dev = self.model.device
        if not (dev == "cpu" or dev == "cuda" or dev.startswith("cuda:")):
            raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {dev!r}")
        _folder("--model-path", self.model.model_path, gguf_ok=True)
        if self.model.tokenizer_path is not None:
            _folder("--tokenizer-path", self.model.tokenizer_path, gguf_ok=True)
        self._validate_load_format()
        return self

    def _validate_load_format(self) -> None:
        fmt, draft = self.model.load_format, self.spec.speculative_draft_model_path
        if fmt not in LOAD_FORMATS:
            raise ConfigError(f"--load-format {fmt!r} is not one of {', '.join(LOAD_FORMATS)}")
        if fmt == "gguf" and not self.model.model_path.endswith(".gguf"):
            raise ConfigError(
                f"--load-format gguf: --model-path {self.model.model_path!r} is not a .gguf file"
            )
        for flag, path in (
            ("--model-path", self.model.model_path),
            ("--speculative-draft-model-path", draft),
        ):
            if (
                fmt == "dummy"
                and path is not None
                and not os.path.isfile(os.path.join(path, "config.json"))
            ):
                raise ConfigError(
                    f"--load-format dummy: {flag} {path!r} has no config.json (the shapes)"
                )

    def _validate_spec(self) -> None:
        sp = self.spec
        q = sp.speculative_draft_model_quantization
        if q is not None and q not in DRAFT_QUANTIZATIONS:
            raise ConfigError(
                f"--speculative-draft-model-quantization {q!r} is not one of {DRAFT_QUANTIZATIONS}"
            )
        if sp.speculative_algorithm is None:
            # reads only the drafter's config / context weights
            prefill = self.disagg.disaggregation_mode == "prefill"
            if sp.speculative_draft_model_quantization is not None and not prefill:
                raise ConfigError(
                    "--speculative-draft-model-quantization needs --speculative-algorithm DSPARK"
                    " (or a draft-kv prefill's --speculative-draft-model-path)"
                )
            if sp.speculative_token_map is not None:
                raise ConfigError("--speculative-token-map needs --speculative-algorithm DSPARK")
            if sp.speculative_disable_by_batch_size is not None:
                raise ConfigError(
                    "--speculative-disable-by-batch-size needs --speculative-algorithm DSPARK"
                )
            if sp.speculative_draft_model_path is not None and not prefill:
                raise ConfigError(
                    "--speculative-draft-model-path needs --speculative-algorithm DSPARK"
                )
            if prefill and sp.speculative_draft_model_path is not None:
                _folder("--speculative-draft-model-path", sp.speculative_draft_model_path)
            return
        if self.disagg.disaggregation_mode == "prefill":
            raise ConfigError(
                "--speculative-algorithm: a prefill server runs no drafter (it samples one token); give "
                "the drafter to the decode server, and to the prefill only --speculative-draft-model-path "
                "for --dspark-pd-handoff draft-kv"
            )
        if sp.speculative_draft_model_path is None:
            raise ConfigError(
                f"--speculative-algorithm {sp.speculative_algorithm} needs --speculative-draft-model-path"
            )
        _folder("--speculative-draft-model-path", sp.speculative_draft_model_path)
        if sp.speculative_num_draft_tokens is not None and sp.speculative_num_draft_tokens < 1:
            raise ConfigError(
                f"--speculative-num-draft-tokens must be >= 1, got {sp.speculative_num_draft_tokens}"
            )
        if sp.speculative_token_map is not None and not os.path.isfile(sp.speculative_token_map):
            raise ConfigError(f"--speculative-token-map {sp.speculative_token_map!r}: no such file")
        n = sp.speculative_disable_by_batch_size
        if n is not None and n < 1:
            raise ConfigError(f"--speculative-disable-by-batch-size must be >= 1, got {n}")
        if not 0.0 <= sp.speculative_dspark_confidence_threshold < 1.0:
            raise ConfigError(
                "--speculative-dspark-confidence-threshold must be in [0, 1), got "
                f"{sp.speculative_dspark_confidence_threshold}"
            )

    def _validate_parallel(self) -> None:
        pp = self.parallel.pp_size
        _positive("--pp-size", pp)
        if pp > 1 and self.spec.speculative_algorithm is not None:
            raise ConfigError(
                f"--pp-size {pp} with --speculative-algorithm {self.spec.speculative_algorithm}: DSpark "
                "runs on a single stage (the drafter needs the target's embedding and LM head, which "
                "sit on different stages, and the taps of every stage at each verify); run the "
                "pipeline on the prefill server (--disaggregation-mode prefill) and DSpark on a "
                "--pp-size 1 decode server"
            )
        if pp > 1 and self.disagg.disaggregation_mode == "decode":
            raise ConfigError(
                f"--pp-size {pp} with --disaggregation-mode decode: the decode server runs --pp-size 1"
            )
        self._validate_nodes()
        port = self.disagg.disaggregation_bootstrap_port
        if not 0 < port < 65536:
            raise ConfigError(f"--disaggregation-bootstrap-port must be in 1..65535, got {port}")

    def _validate_nodes(self) -> None:
        pc = self.parallel
        _positive("--nnodes", pc.nnodes)
        if not 0 <= pc.node_rank < pc.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{pc.nnodes - 1}, got {pc.node_rank}")
        if pc.nnodes == 1:
            return
        if pc.pp_size % pc.nnodes:
            raise ConfigError(
                f"--pp-size {pc.pp_size} over --nnodes {pc.nnodes}: each node runs the same number "
                "of stages, so --pp-size must be a multiple of --nnodes"
            )
        if pc.dist_init_addr is None:
            raise ConfigError(f"--nnodes {pc.nnodes} needs --dist-init-addr HOST:PORT (node 0's)")
        pc.init_host_port()
        if pc.dist_init_port is not None:
            raise ConfigError(
                "--dist-init-port is the one-host rendezvous; across hosts give --dist-init-addr"
            )
        if self.model.device != "cpu":
            raise ConfigError(
                f"--nnodes {pc.nnodes} with --device {self.model.device}: the pipeline spans hosts over "
                "ZMQ tcp:// between CPU stages only (NCCL across GPU hosts is not implemented)"
            )
        if pc.dist_timeout <= 0:
            raise ConfigError(f"--dist-timeout must be positive, got {pc.dist_timeout}")

    def flat(self) -> dict[str, Any]:
        """All leaf settings as one flat dict (the shape of SGLang's /server_info)."""
        out: dict[str, Any] = {}
        for section in dataclasses.fields(self):
            out.update(dataclasses.asdict(getattr(self, section.name)))
        return out

    def replace(self, **leaves: Any) -> "Config":
        """A new Config with the named leaf fields changed (names as in `flat()`)."""
        sections = {}
        for section in dataclasses.fields(self):
            sub = getattr(self, section.name)
            names = {f.name for f in dataclasses.fields(sub)}
            changes = {k: v for k, v in leaves.items() if k in names}
            sections[section.name] = dataclasses.replace(sub, **changes)
        unknown = set(leaves) - set(self.flat())
        if unknown:
            raise ConfigError(f"unknown settings: {sorted(unknown)}")
        return Config(**sections)


def _positive(flag: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{flag} must be positive, got {value}")


def _folder(flag: str, path: str, gguf_ok: bool = False) -> None:
    """A model folder (or, where `gguf_ok`, a .gguf file) must exist here: nothing is downloaded, so
    a hub id gets the command that fetches it."""
    if os.path.isdir(path) or (gguf_ok and path.endswith(".gguf") and os.path.isfile(path)):
        return
    if gguf_ok and path.endswith(".gguf"):
        raise ConfigError(f"{flag} {path!r}: no such GGUF file")
    msg = f"{flag} {path!r} is not a folder; sparkrelay reads local folders only (no Hugging Face hub downloads)"
    parts = path.split("/")
    if (
        len(parts) == 2
        and all(parts)
        and not path.startswith((".", "~"))
        and not os.path.isdir(parts[0])
    ):
        # org/name, and `org` is no local folder: a hub id
        local = f"models/{parts[1]}"
        msg += f": fetch it with `huggingface-cli download {path} --local-dir {local}` and pass {flag} {local}"
    else:
        msg += ": pass the path of a folder holding config.json and the *.safetensors weights"
    raise ConfigError(msg)


# SGLang server flags sparkrelay does not implement: refused by name (not as a typo), with the
# reason where one helps. Flags sparkrelay shares with SGLang are the config tree's own; everything
# else is argparse's "unrecognized".
SGLANG_ONLY_FLAGS: dict[str, str] = {
    "--enable-radix-cache": "the prefix (radix) cache is on by default; --disable-radix-cache turns it off",
    "--disaggregation-decode-enable-radix-cache": "a decode's prefix cache is on unless --disable-radix-cache",
    "--trust-remote-code": "sparkrelay runs its own model code and loads none from the model folder",
    "--random-seed": "sparkrelay's is --seed",
    "--mem-fraction-static": "size the KV cache with --max-total-tokens",
    "--max-prefill-tokens": "--chunked-prefill-size is the token budget of a prefill step",
    "--tp-size": "there is no tensor parallelism; --pp-size splits the layers into pipeline stages",
    **dict.fromkeys(
        (
            "--tp",
            "--tensor-parallel-size",
            "--dp-size",
            "--dp",
            "--data-parallel-size",
            "--ep-size",
            "--ep",
            "--enable-dp-attention",
            "--enable-dp-lm-head",
            "--moe-a2a-backend",
            "--enable-ep-moe",
            "--enable-deepep-moe",
            "--schedule-policy",
            "--schedule-conservativeness",
            "--cpu-offload-gb",
            "--skip-tokenizer-init",
            "--quantization",
            "--kv-cache-dtype",
            "--attention-backend",
            "--prefill-attention-backend",
            "--decode-attention-backend",
            "--sampling-backend",
            "--cuda-graph-max-bs",
            "--cuda-graph-bs",
            "--disable-cuda-graph",
            "--disable-cuda-graph-padding",
            "--enable-mixed-chunk",
            "--enable-hierarchical-cache",
            "--disable-overlap-schedule",
            "--enable-two-batch-overlap",
            "--enable-lora",
            "--lora-paths",
            "--max-loras-per-batch",
            "--reasoning-parser",
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--disaggregation-ib-device",
            "--stream-interval",
            "--watchdog-timeout",
            "--revision",
            "--download-dir",
            "--model-impl",
            "--is-embedding",
            "--tokenizer-mode",
            "--json-model-override-args",
            "--base-gpu-id",
            "--gpu-id-step",
            "--torch-compile-max-bs",
            "--allow-auto-truncate",
            "--enable-memory-saver",
            "--enable-custom-logit-processor",
        ),
        "",
    ),
}
SGLANG_ONLY_DEST = "sglang_only_flags"


class _SGLangOnly(argparse.Action):
    """Collects the SGLang-only flags given (with their value, if any) so that all are named in one
    message."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, given + [option_string])


def sglang_only_message(flags: list[str]) -> str:
    flags = list(dict.fromkeys(flags))
    names = ", ".join(flags)
    verb = "is an SGLang flag" if len(flags) == 1 else "are SGLang flags"
    why = "; ".join(f"{f}: {SGLANG_ONLY_FLAGS[f]}" for f in flags if SGLANG_ONLY_FLAGS.get(f))
    return (
        f"{names} {verb} sparkrelay does not implement; remove {'it' if len(flags) == 1 else 'them'} (--help "
        "lists the flags sparkrelay takes)" + (f". {why}" if why else "")
    )


def _leaf_fields():
    for section in dataclasses.fields(Config):
        for leaf in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            yield section.name, leaf


def _help(leaf: dataclasses.Field) -> str:
    """The field's help with its default, unless the help already says what the default is."""
    text = leaf.metadata.get("help") or ""
    if "(default" in text or leaf.default is False:
        return text
    return f"{text} (default: {'none' if leaf.default is None else leaf.default})"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One argument group per config section, one flag per leaf field, in the tree's order."""
    groups: dict[str, Any] = {}
    for section, leaf in _leaf_fields():
        if section not in groups:
            title = Config.__dataclass_fields__[section].metadata.get("title", section)
            groups[section] = parser.add_argument_group(title)
        group, flag, meta = groups[section], "--" + leaf.name.replace("_", "-"), leaf.metadata
        # a switch, as in SGLang (`--enable-torch-compile`); a True default
        if isinstance(leaf.default, bool):
            # (--enable-metrics) is a switch already in force: accepted, changes nothing
            group.add_argument(
                flag, dest=leaf.name, action="store_true", default=leaf.default, help=_help(leaf)
            )
            continue
        ftype = meta.get("type") or type(leaf.default)
        group.add_argument(
            flag,
            dest=leaf.name,
            type=ftype,
            default=leaf.default,
            choices=meta.get("choices"),
            help=_help(leaf),
        )
    for flag in SGLANG_ONLY_FLAGS:  # hidden from --help; named together by config_from_args
        parser.add_argument(
            flag, dest=SGLANG_ONLY_DEST, action=_SGLangOnly, nargs="?", help=argparse.SUPPRESS
        )


def config_from_args(args: argparse.Namespace) -> Config:
    sglang_only = getattr(args, SGLANG_ONLY_DEST, None)
    if sglang_only:
        raise ConfigError(sglang_only_message(sglang_only))
    leaves = {leaf.name: getattr(args, leaf.name) for _, leaf in _leaf_fields()}
    return Config().replace(**leaves).validate()
