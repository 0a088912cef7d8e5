"""HTTP request models (SGLang-native and OpenAI) and their translation into engine requests.

Every translation error is a RequestError whose message names the offending field (HTTP 400).
Unknown fields are rejected (extra="forbid") rather than silently ignored. OpenAI's `user` is
accepted and ignored; the SGLang fields that sglang-router adds to every body it forwards
(`return_hidden_states`, `continue_final_message`, `separate_reasoning`, ... see SGLANG_EXTRAS) are
accepted at their defaults and refused by name when they ask for something this server does not do.
The PD bootstrap fields are accepted everywhere and attached to each engine item (`with_bootstrap`);
an aggregated engine ignores them.

    common.py     Limits, the strict base models, the checks every route shares
    generate.py   SGLang's native /generate
    openai.py     /v1/completions and /v1/chat/completions
    structured.py structured outputs: the clients' spellings -> SGLang's grammar fields
    tools.py      tool calls: the plan (template format, constraint), the parsers
    bootstrap.py  the PD router's bootstrap fields -> one Bootstrap per engine item

The translations tokenize (and render chat templates): the HTTP layer runs them off the event loop.
"""

from sparkrelay.scheduler.request import (
    RequestError,
    SamplingParams,
)  # what the translations raise and build
from sparkrelay.server.protocol.bootstrap import with_bootstrap
from sparkrelay.server.protocol.common import SGLANG_EXTRAS, Limits
from sparkrelay.server.protocol.generate import (
    GenerateRequest,
    GenerateSamplingParams,
    generate_items,
)
from sparkrelay.server.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    StreamOptions,
    chat_items,
    chat_prompt_ids,
    completion_items,
    echo_texts,
)
from sparkrelay.server.protocol.tools import StreamParser as ToolStreamParser
from sparkrelay.server.protocol.tools import ToolPlan
from sparkrelay.server.protocol.tools import parse as parse_tool_calls
from sparkrelay.server.protocol.tools import plan as tool_plan

__all__ = [
    "RequestError",
    "SamplingParams",
    "with_bootstrap",
    "SGLANG_EXTRAS",
    "Limits",
    "GenerateRequest",
    "GenerateSamplingParams",
    "generate_items",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "StreamOptions",
    "chat_items",
    "chat_prompt_ids",
    "completion_items",
    "echo_texts",
    "ToolStreamParser",
    "parse_tool_calls",
    "tool_plan",
    "ToolPlan",
]
