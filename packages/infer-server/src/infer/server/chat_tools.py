"""What a chat request's `tools` and `tool_choice` mean for its answer, checked against each other.

The schema (infer.server.schemas) checks each field's shape; the rules that relate fields, or
that OpenAI answers with 400, are here, each error naming its field:
- a function's `parameters` must be a JSON Schema object (`{"type": "object", ...}`), as OpenAI
  requires; left out, the function takes no arguments;
- function names are unique;
- `tool_choice` naming a function needs that function in `tools`; "required" or a named choice
  needs tools at all.

`tool_choice` "none" means the tools are neither shown to the model nor looked for in its answer.
A named or "required" choice starts the answer with the opening of the family's call format (see
infer.server.tool_parsers.ToolCallFormat), and the rest of the call is held to a grammar
(infer.server.tool_grammar), which also ends the answer at the call's closing marker (not a
stop string: the model may write that marker inside a string of the arguments): the answer is
always a call to one of the tools whose arguments validate against its `parameters`, then, with
parallel tool calls (the default), as many more such calls as the model writes, each held to the
same grammar. Those parameters must then be in the JSON Schema subset structured output
enforces; a keyword outside it is a 400 naming the tool's field.

`parallel_tool_calls: false` holds an answer to at most one call: a forced one's grammar ends it
after the first; with "auto" the calls after the first are dropped (infer.server.chat_output), as
vLLM does.
"""

from dataclasses import dataclass
from typing import Any

from infer.engine.grammar_spec import GrammarSpec
from infer.server import errors
from infer.server.errors import ApiError
from infer.server.schemas import NamedToolChoice, Tool
from infer.server.tool_grammar import ToolSchemaError, forced_call_grammar
from infer.server.tool_parsers import ToolCallFormat


@dataclass(frozen=True)
class ToolUse:
    """The tools in play for one request."""

    template_tools: list[dict[str, Any]]  # as the chat template takes them
    tool_names: frozenset[str]
    forced_name: str | None = None  # tool_choice {"type": "function", "function": {"name": ...}}
    required: bool = False  # tool_choice "required": some call, the model picks which
    # parallel_tool_calls (OpenAI's default: true): several calls in one answer, else at most one
    parallel_calls: bool = True

    @property
    def forced(self) -> bool:
        return self.forced_name is not None or self.required

    def call_prefix(self, tool_format: ToolCallFormat) -> str:
        """The start of the answer written for the model ("" when the model may answer freely)."""
        if self.forced_name is not None:
            return tool_format.named_call_prefix(self.forced_name)
        return tool_format.any_call_prefix if self.required else ""

    def grammar(self, tool_format: ToolCallFormat) -> GrammarSpec | None:
        """What the answer after `call_prefix` is held to (None when the model answers freely):
        the rest of a call to the named function, or to any of the tools for "required", and with
        `parallel_calls` any more such calls after it. An ApiError 400 names a tool whose
        parameters no grammar can enforce."""
        if not self.forced:
            return None
        tools = [
            (tool["function"]["name"], tool["function"].get("parameters")) for tool in self.template_tools
        ]
        try:
            return forced_call_grammar(
                tool_format, tools, self.forced_name, several_calls=self.parallel_calls
            )
        except ToolSchemaError as error:
            code = "unsupported_value" if error.keyword else "invalid_value"
            raise ApiError(400, str(error), errors.INVALID_REQUEST, error.field, code) from None


def tool_use(
    tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel_tool_calls: bool | None = None
) -> ToolUse | None:
    """A request's `tools`, `tool_choice` and `parallel_tool_calls` (null: OpenAI's default,
    true), checked (ApiError 400 naming the field); None when no tools are in play (none given,
    or tool_choice "none")."""
    tools = tools or []
    forced_name = choice.function.name if choice is not None and not isinstance(choice, str) else None
    if not tools:
        if forced_name is not None or choice == "required":
            raise _bad(
                "tool_choice",
                "tool_choice that asks for a tool call needs tools; send tools or leave tool_choice out",
            )
        return None
    names = []
    for index, tool in enumerate(tools):
        _check_parameters(tool.function.parameters, f"tools.{index}.function.parameters")
        if tool.function.name in names:
            raise _bad(
                f"tools.{index}.function.name",
                f"function name {tool.function.name!r} appears twice in tools; names must be unique",
            )
        names.append(tool.function.name)
    if forced_name is not None and forced_name not in names:
        raise _bad(
            "tool_choice.function.name",
            f"tool_choice names function {forced_name!r}, which is not in tools ({', '.join(names)}); "
            "name one of those",
        )
    if choice == "none":
        return None
    return ToolUse(
        template_tools=[tool.model_dump(exclude_none=True) for tool in tools],
        tool_names=frozenset(names),
        forced_name=forced_name,
        required=choice == "required",
        parallel_calls=parallel_tool_calls is not False,
    )


def _check_parameters(parameters: Any, field: str) -> None:
    if parameters is None:
        return
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        shown = parameters.get("type") if isinstance(parameters, dict) else type(parameters).__name__
        raise _bad(
            field,
            f'parameters must be a JSON Schema object ({{"type": "object", "properties": ...}}), '
            f"got {shown!r}",
        )
    if not isinstance(parameters.get("properties", {}), dict):
        raise _bad(f"{field}.properties", "properties of a JSON Schema object must be an object")


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", errors.INVALID_REQUEST, field, "invalid_value")
