"""The import path the docs give users for their own text environments (`module: file.py:ClassName` subclasses
`rljob.runtime.llm.textenv.TextEnv`): kept stable while the code lives in `rljob.runtime.llm.episodes.textenv`."""

from rljob.runtime.llm.episodes.textenv import Message, Row, StepResult, TextEnv, ToolCall, parse_tool_calls

__all__ = ["Message", "Row", "StepResult", "TextEnv", "ToolCall", "parse_tool_calls"]
