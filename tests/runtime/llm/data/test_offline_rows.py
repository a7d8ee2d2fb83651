"""The offline stages' rows: every bad row named with its number and column; good rows tokenized as trained."""

from __future__ import annotations

import pytest

from rljob.api.spec import DatasetSpec, LLMTask
from rljob.runtime.llm.data.offline_rows import check_offline_rows, encode_offline_row, offline_texts
from rljob.runtime.llm.models.policy import CHAT_TEXT, build_char_tokenizer

TASK = LLMTask(dataset=DatasetSpec(path="rows.jsonl"))


def one_problem(stage: str, rows: list[dict]) -> str:
    [(field, message)] = check_offline_rows(stage, TASK, rows)
    assert field == "spec.task.llm.dataset"
    return message


def test_a_preference_row_missing_a_side_is_named_with_its_row_number_and_column():
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {"prompt": "3+3=", "chosen": "6"},
    ]
    message = one_problem("dpo", rows)
    assert "1 of 3 rows are not dpo rows" in message
    assert "row 2 has no 'rejected'" in message
    assert "'prompt', 'chosen' and 'rejected'" in message


def test_every_bad_row_is_counted_and_the_first_five_named():
    rows = [{"prompt": f"{i}", "rejected": "x"} for i in range(8)] + [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    message = one_problem("dpo", rows)
    assert message.startswith("8 of 9 rows are not dpo rows: row 0 has no 'chosen'")
    assert "row 4" in message and "row 5" not in message and "(and 3 more rows)" in message


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "q"}, "row 0 has no 'completion'"),
        ({"completion": "a"}, "row 0 has no 'prompt'"),
        ({"prompt": "q", "completion": ""}, "row 0 'completion' is empty"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "row 0 'messages' must be a list of at least two"),
        (
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
            "row 0 the last of 'messages' must be the assistant's (got role 'user')",
        ),
    ],
)
def test_sft_rows_need_a_prompt_and_completion_or_a_chat_ending_with_the_assistant(row, expected):
    assert expected in one_problem("sft", [row])


def test_a_chat_response_must_be_one_assistant_message():
    row = {"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}
    assert "row 0 'chosen' must be a text or one assistant message" in one_problem("dpo", [row])


def test_good_rows_of_both_formats_pass():
    assert check_offline_rows("sft", TASK, [{"prompt": "q", "completion": "a"}]) == []
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert check_offline_rows("sft", TASK, [chat]) == []
    conversational = {
        "prompt": [{"role": "user", "content": "q"}],
        "chosen": [{"role": "assistant", "content": "a"}],
        "rejected": [{"role": "assistant", "content": "b"}],
    }
    assert check_offline_rows("dpo", TASK, [conversational]) == []


def test_a_completion_is_its_tokens_and_eos_after_the_rendered_prompt():
    row = {"prompt": "3+4=", "completion": "7"}
    tokenizer = build_char_tokenizer(offline_texts(TASK, [row], CHAT_TEXT))
    encoded = encode_offline_row("sft", TASK, row, tokenizer)
    assert tokenizer.decode(encoded.prompt, skip_special_tokens=True) == "3+4="
    [response] = encoded.responses
    assert response[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(response, skip_special_tokens=True) == "7"


def test_a_chat_row_is_the_chat_template_up_to_the_assistant_turn_then_its_content():
    row = {"messages": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]}
    tokenizer = build_char_tokenizer(offline_texts(TASK, [row], CHAT_TEXT))
    encoded = encode_offline_row("sft", TASK, row, tokenizer)
    assert tokenizer.decode(encoded.prompt, skip_special_tokens=True) == "user: 3+4=\nassistant: "
    assert tokenizer.decode(encoded.responses[0], skip_special_tokens=True) == "7"


def test_a_preference_row_gives_the_prompt_and_both_responses():
    row = {"prompt": "3+4=", "chosen": [{"role": "assistant", "content": "7"}], "rejected": "9"}
    tokenizer = build_char_tokenizer(offline_texts(TASK, [row], CHAT_TEXT))
    encoded = encode_offline_row("dpo", TASK, row, tokenizer)
    assert [tokenizer.decode(r, skip_special_tokens=True) for r in encoded.responses] == ["7", "9"]
