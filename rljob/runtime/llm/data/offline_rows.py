"""The rows of the offline stages (`algorithm.name` sft or dpo): checked with row numbers, then tokenized.

sft rows: a prompt (the `task.llm.dataset.promptKey` column, rendered as RL prompts are: template, system prompt, chat
template) and a `completion`; or `messages`, a chat whose last message is the assistant's (the completion) and whose
earlier messages are the prompt, rendered with the tokenizer's chat template.

dpo and reward_model rows: a prompt (plain text, rendered as above, or a list of chat messages) and two responses,
`chosen` and
`rejected`: each plain text or a one-message list `[{"role": "assistant", "content": ...}]` (TRL's conversational
preference format).

A completion is trained on its tokens and the end-of-sequence token (the model learns to stop there); the prompt is
not trained on. Every problem names the row (0-based, in file order) and the column, and the whole dataset is
checked before the first step, so nothing trains on a half-usable dataset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob.api.spec import LLMTask
from rljob.runtime.llm.data.rows import Row, encode_prompt

FIELD = "spec.task.llm.dataset"
COMPLETION, MESSAGES, CHOSEN, REJECTED = "completion", "messages", "chosen", "rejected"
SHOWN = 5
"""Bad rows named in one message at most (the count of the others follows)."""


@dataclass(frozen=True)
class Encoded:
    """A row as token ids: the prompt and one (sft) or two (chosen, rejected) responses, each ending in EOS."""

    prompt: list[int]
    responses: tuple[list[int], ...]


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
        and all(isinstance(m.get("content"), str) for m in value)
    )


def _response_problem(value: Any, column: str) -> str | None:
    if isinstance(value, str):
        return None if value else f"{column!r} is empty"
    if _is_chat(value) and len(value) == 1 and value[0]["role"] == "assistant" and value[0]["content"]:
        return None
    return f"{column!r} must be a text or one assistant message [{{'role': 'assistant', 'content': ...}}]"


def _prompt_problem(value: Any, column: str) -> str | None:
    if isinstance(value, str) or _is_chat(value):
        return None
    return f"{column!r} must be a text or a list of chat messages ({{'role': ..., 'content': ...}})"


def row_problem(stage: str, row: Row, prompt_key: str) -> str | None:
    """What keeps one row from being a `stage` example, or None."""
    if stage == "sft":
        if MESSAGES in row:
            messages = row[MESSAGES]
            if not _is_chat(messages) or len(messages) < 2:
                return f"{MESSAGES!r} must be a list of at least two chat messages ({{'role': ..., 'content': ...}})"
            if messages[-1]["role"] != "assistant":
                return f"the last of {MESSAGES!r} must be the assistant's (got role {messages[-1]['role']!r})"
            return None
        missing = [c for c in (prompt_key, COMPLETION) if c not in row]
        if missing:
            return (
                f"has no {' or '.join(repr(c) for c in missing)} (an sft row needs {prompt_key!r} and "
                f"{COMPLETION!r}, or {MESSAGES!r})"
            )
        return _prompt_problem(row[prompt_key], prompt_key) or _response_problem(row[COMPLETION], COMPLETION)
    missing = [c for c in (prompt_key, CHOSEN, REJECTED) if c not in row or row[c] is None]
    if missing:
        return (
            f"has no {' or '.join(repr(c) for c in missing)} (a {stage} row needs {prompt_key!r}, {CHOSEN!r} and "
            f"{REJECTED!r})"
        )
    return (
        _prompt_problem(row[prompt_key], prompt_key)
        or _response_problem(row[CHOSEN], CHOSEN)
        or _response_problem(row[REJECTED], REJECTED)
    )


def check_offline_rows(stage: str, task: LLMTask, rows: list[Row]) -> list[tuple[str, str]]:
    """(field, message) naming the rows that cannot be `stage` examples (the first few, and how many in all)."""
    bad = [(i, why) for i, row in enumerate(rows) if (why := row_problem(stage, row, task.dataset.prompt_key))]
    if not bad:
        return []
    shown = "; ".join(f"row {i} {why}" for i, why in bad[:SHOWN])
    more = f" (and {len(bad) - SHOWN} more rows)" if len(bad) > SHOWN else ""
    return [(FIELD, f"{len(bad)} of {len(rows)} rows are not {stage} rows: {shown}{more}; fix or drop them")]


def _response_text(value: Any) -> str:
    return value if isinstance(value, str) else value[0]["content"]


def offline_texts(task: LLMTask, rows: list[Row], chat_markup: str) -> list[str]:
    """Every text of the rows (prompts, responses, chats), and `chat_markup` (the chat template's own text) when a
    row is a chat: what the builtin tokenizer must cover."""
    texts: list[str] = []
    key = task.dataset.prompt_key
    for row in rows:
        values = [row.get(MESSAGES), row.get(key), row.get(COMPLETION), row.get(CHOSEN), row.get(REJECTED)]
        for value in values:
            if isinstance(value, str):
                texts.append(value)
            elif _is_chat(value):
                texts += [m["content"] for m in value] + [" ".join(m["role"] for m in value), chat_markup]
    return texts


def _chat_prompt(messages: list[dict[str, str]], task: LLMTask, tokenizer: Any) -> list[int]:
    chat = list(messages)
    if task.system_prompt is not None and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": task.system_prompt})
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def encode_offline_row(stage: str, task: LLMTask, row: Row, tokenizer: Any) -> Encoded:
    """A checked row's prompt and response token ids (each response ends with the end-of-sequence token)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def response(text: str) -> list[int]:
        return [*tokenizer(text, add_special_tokens=False)["input_ids"], *eos]

    if stage == "sft" and MESSAGES in row:
        messages = row[MESSAGES]
        return Encoded(_chat_prompt(messages[:-1], task, tokenizer), (response(messages[-1]["content"]),))
    value = row[task.dataset.prompt_key]
    prompt = _chat_prompt(value, task, tokenizer) if _is_chat(value) else encode_prompt(task, row, tokenizer)
    columns = (COMPLETION,) if stage == "sft" else (CHOSEN, REJECTED)
    return Encoded(prompt, tuple(response(_response_text(row[c])) for c in columns))
