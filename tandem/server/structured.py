"""A chat request's structured outputs and forced tool choice as the grammar its generation is
held to (GenerationParams.grammar), checked before the request reaches the engine: a shape
OpenAI's API does not take, or a schema llguidance cannot compile, is a 400 naming
``response_format`` (or ``tool_choice`` / ``tools``), never a failure of the engine.
"""

from __future__ import annotations

from tandem import grammar
from tandem.models.chat import template_info
from tandem.models.structured import StructuredError, build_lark
from tandem.server.errors import bad_request
from tandem.server.schema import ChatCompletionRequest
from tandem.server.state import ServerState

MAX_ERROR_CHARS = 600  # llguidance quotes the grammar around the fault; enough to find it


def chat_grammar(state: ServerState, req: ChatCompletionRequest, thinking: bool) -> str | None:
    """The request's grammar, None when it constrains nothing. On a worker thread: the first
    one builds the tokenizer bridge (under a second) and a schema compiles in milliseconds."""
    tools = req.tools if req.tool_choice != "none" else None
    try:
        lark = build_lark(thinking=thinking, special_ids=state.tokenizer.special_ids,
                          response_format=req.response_format, tools=tools,
                          tool_choice=req.tool_choice,
                          parallel_tool_calls=req.parallel_tool_calls,
                          tool_format=template_info(state.chat_template).tool_format)
    except StructuredError as e:
        raise bad_request(str(e), e.param) from None
    if lark is None:
        return None
    param = "response_format" if req.response_format is not None \
        and req.response_format.get("type") not in (None, "text") else "tools"
    if not grammar.available():
        raise bad_request("structured outputs need the llguidance package, which this server "
                          "lacks", param, "unsupported_parameter")
    if req.tandem_forced_output is not None:
        raise bad_request("tandem_forced_output cannot be combined with a grammar", param)
    compiled = grammar.from_lark(lark)
    try:
        grammar.check(compiled, state.tokenizer)
    except grammar.GrammarError as e:
        raise bad_request(f"the {param} schema does not compile: {str(e)[:MAX_ERROR_CHARS]}",
                          param) from None
    return compiled
