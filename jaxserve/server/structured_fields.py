"""The request fields that ask for structured outputs, and their one mapping to
StructuredOutputsParams (sampling/params.py):

    response_format      OpenAI: {"type": "text" | "json_object" | "json_schema",
                         "json_schema": {"name", "description", "schema", "strict"}}
    structured_outputs   vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object"}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names

At most one constraint per request (two would have to agree; vLLM refuses that too).
Whether a schema / regex / grammar is valid is checked at intake
(frontend/input_processor.py -> structured/grammar.py), which answers 400 naming it.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling.params import SamplingParamsError, StructuredOutputsParams


class _Base(BaseModel):
    # strict like server/protocol.py's models: `strict: "yes"` is a 400, not a guess
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


class JsonSchemaFormat(_Base):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Base):
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def structured_params(req: Any) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None; SamplingParamsError (400) naming the
    field for two constraints or a malformed one."""
    given: list[tuple[str, dict[str, Any]]] = []
    rf: ResponseFormat | None = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise SamplingParamsError("response_format", "type json_schema needs "
                                                         "json_schema.schema")
        given.append(("response_format", {"json": rf.json_schema.json_schema}))
    so: StructuredOutputsField | None = req.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                  "grammar": so.grammar, "json_object": bool(so.json_object)}
        given.append(("structured_outputs",
                      {k: v for k, v in fields.items() if v is not None and v is not False}))
    for kind in ("json", "regex", "choice", "grammar"):
        v = getattr(req, f"guided_{kind}")
        if v is not None:
            given.append((f"guided_{kind}", {kind: v}))
    if not given:
        return None
    if len(given) > 1:
        raise SamplingParamsError(given[1][0], "only one structured output constraint per "
                                               f"request, got {[g[0] for g in given]}")
    param, kw = given[0]
    try:
        return StructuredOutputsParams(**kw)
    except SamplingParamsError as e:
        raise SamplingParamsError(param, str(e).split(": ", 1)[-1]) from None
