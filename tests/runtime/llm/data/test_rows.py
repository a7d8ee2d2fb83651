"""Prompt data for llm jobs: rows from every source, errors that name the field, prompts, and a resumable order."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rljob.api.spec import DatasetSpec, LLMTask
from rljob.runtime.llm.data.rows import (
    DatasetError,
    PromptStream,
    arithmetic_rows,
    encode_prompt,
    load_rows,
    render_prompt,
    split_off,
)
from rljob.runtime.llm.models.policy import CHAT_TEMPLATE, build_char_tokenizer

ROWS = [{"question": f"{a}*{a}?", "solution": str(a * a), "topic": "squares"} for a in range(6)]


def task_for(path, **dataset) -> LLMTask:
    return LLMTask(dataset=DatasetSpec(path=str(path), prompt_key="question", answer_key="solution", **dataset))


# --- sources ------------------------------------------------------------------------------------


def test_builtin_arithmetic_rows_are_a_function_of_the_seed():
    rows = load_rows(LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=50)), seed=3)
    assert rows == arithmetic_rows(50, 3) == load_rows(LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=50)), 3)
    assert rows != arithmetic_rows(50, 4)
    assert len(rows) == 50
    for row in rows:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["answer"] == str(int(a) + int(b))


def test_jsonl_rows_load_skipping_blank_lines(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS[:3]) + "\n\n" + json.dumps(ROWS[3]) + "\n")
    assert load_rows(task_for(path)) == ROWS[:4]


def test_json_rows_load_from_a_list_or_a_data_object(tmp_path):
    as_list, as_object = tmp_path / "list.json", tmp_path / "object.json"
    as_list.write_text(json.dumps(ROWS))
    as_object.write_text(json.dumps({"data": ROWS, "version": 2}))
    assert load_rows(task_for(as_list)) == ROWS
    assert load_rows(task_for(as_object)) == ROWS


def test_parquet_rows_load(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(task_for(path)) == ROWS


def test_a_directory_loads_the_files_of_its_split(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), tmp_path / "train-0.parquet")
    (tmp_path / "train-1.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS[2:4]))
    (tmp_path / "test-0.json").write_text(json.dumps(ROWS[4:]))
    (tmp_path / "README.md").write_text("not data")
    assert load_rows(task_for(tmp_path)) == ROWS[:4]
    assert load_rows(task_for(tmp_path, split="test")) == ROWS[4:]


def test_a_directory_without_split_prefixed_files_loads_them_all(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]))
    (tmp_path / "b.json").write_text(json.dumps(ROWS[1:3]))
    assert load_rows(task_for(tmp_path)) == ROWS[:3]


# --- errors name the field ----------------------------------------------------------------------


def test_a_missing_file_names_the_path_field(tmp_path):
    with pytest.raises(DatasetError, match=r"^spec\.task\.llm\.dataset\.path: .*nowhere\.jsonl does not exist"):
        load_rows(task_for(tmp_path / "nowhere.jsonl"))


def test_a_bad_json_line_is_reported_with_its_line_number(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{'single': quotes}\n")
    with pytest.raises(DatasetError, match=r"^spec\.task\.llm\.dataset\.path: .*train\.jsonl line 3 is not JSON"):
        load_rows(task_for(path))


def test_a_json_file_that_holds_no_list_is_refused(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(DatasetError, match=r"^spec\.task\.llm\.dataset\.path: .*must hold a list of objects"):
        load_rows(task_for(path))


def test_an_unreadable_parquet_file_names_the_path_field(tmp_path):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1 this is not a parquet footer")
    with pytest.raises(DatasetError, match=r"^spec\.task\.llm\.dataset\.path: .*not a readable Parquet file"):
        load_rows(task_for(path))


def test_an_absent_prompt_or_answer_key_names_the_key_field_and_the_columns(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    wrong_prompt = LLMTask(dataset=DatasetSpec(path=str(path), prompt_key="prompt", answer_key="solution"))
    with pytest.raises(DatasetError) as info:
        load_rows(wrong_prompt)
    message = str(info.value)
    assert message.startswith("spec.task.llm.dataset.promptKey: row 0 has no column 'prompt'")
    assert "question, solution, topic" in message
    wrong_answer = LLMTask(dataset=DatasetSpec(path=str(path), prompt_key="question", answer_key="answer"))
    with pytest.raises(DatasetError, match=r"^spec\.task\.llm\.dataset\.answerKey: row 0 has no column 'answer'"):
        load_rows(wrong_answer)


def test_an_empty_dataset_is_refused(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n")
    with pytest.raises(DatasetError, match=r"^spec\.task\.llm\.dataset: the dataset has no rows"):
        load_rows(task_for(path))


# --- rendering ----------------------------------------------------------------------------------


def test_render_fills_the_template_from_the_row():
    task = LLMTask(
        dataset=DatasetSpec(builtin="arithmetic", prompt_key="question"),
        prompt_template="[{topic}] Q: {prompt} A:",
    )
    assert render_prompt(task, ROWS[2], tokenizer=None) == "[squares] Q: 2*2? A:"


def test_a_list_of_options_renders_as_lettered_lines_for_a_multiple_choice_template():
    task = LLMTask(dataset=DatasetSpec(builtin="arithmetic"), prompt_template="{prompt}\n{choices}\nAnswer:")
    row = {"prompt": "2+2?", "choices": ["3", 4, "five"], "answer": "B"}
    assert render_prompt(task, row, tokenizer=None) == "2+2?\nA. 3\nB. 4\nC. five\nAnswer:"


def test_render_puts_the_system_prompt_first():
    task = LLMTask(dataset=DatasetSpec(builtin="arithmetic"), system_prompt="Answer with a number.")
    assert render_prompt(task, {"prompt": "1+2=", "answer": "3"}, tokenizer=None) == "Answer with a number.\n1+2="


def test_render_applies_the_tokenizers_chat_template():
    tokenizer = build_char_tokenizer(["abc"])
    task = LLMTask(
        dataset=DatasetSpec(builtin="arithmetic"),
        prompt_template="Q {prompt}",
        system_prompt="be brief",
        apply_chat_template=True,
    )
    text = render_prompt(task, {"prompt": "1+2=", "answer": "3"}, tokenizer)
    assert text == "system: be brief\nuser: Q 1+2=\nassistant: "
    without_system = LLMTask(dataset=DatasetSpec(builtin="arithmetic"), apply_chat_template=True)
    assert render_prompt(without_system, {"prompt": "1+2="}, tokenizer) == "user: 1+2=\nassistant: "


def test_a_chat_template_that_writes_the_bos_itself_gets_no_second_one():
    """Llama-3's, Gemma's and Mistral's templates start with `{{ bos_token }}` and their tokenizers add one too."""
    tokenizer = build_char_tokenizer(["system: user: assistant: \n", "be brief", "1+2="])
    tokenizer.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    bos = tokenizer.bos_token_id
    row = {"prompt": "1+2=", "answer": "3"}
    chat = LLMTask(dataset=DatasetSpec(builtin="arithmetic"), system_prompt="be brief", apply_chat_template=True)
    ids = encode_prompt(chat, row, tokenizer)
    assert ids[0] == bos and ids.count(bos) == 1
    assert tokenizer.decode(ids[1:]) == "system: be brief\nuser: 1+2=\nassistant: "
    # A template without it, and no template (a base model), keep the BOS the tokenizer adds.
    tokenizer.chat_template = CHAT_TEMPLATE
    for task in (chat, LLMTask(dataset=DatasetSpec(builtin="arithmetic"))):
        ids = encode_prompt(task, row, tokenizer)
        assert ids[0] == bos and ids.count(bos) == 1


# --- order --------------------------------------------------------------------------------------


def test_the_stream_takes_every_row_exactly_once_per_epoch_across_epoch_boundaries():
    stream = PromptStream(size=10, seed=5)
    taken = stream.take(7) + stream.take(7) + stream.take(7) + stream.take(9)  # 30 = three epochs
    for epoch in range(3):
        assert sorted(taken[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    assert taken[:10] != taken[10:20]  # each epoch is reshuffled
    assert stream.state_dict() == {"epoch": 2, "position": 10}
    assert Counter(taken) == dict.fromkeys(range(10), 3)


def test_the_stream_order_is_a_function_of_the_seed():
    assert PromptStream(20, seed=1).take(40) == PromptStream(20, seed=1).take(40)
    assert PromptStream(20, seed=1).take(20) != PromptStream(20, seed=2).take(20)


@pytest.mark.parametrize("stop_after", [0, 3, 10, 13, 20])
def test_a_restored_stream_continues_the_exact_same_sequence(stop_after):
    uninterrupted = PromptStream(size=10, seed=7).take(35)
    first = PromptStream(size=10, seed=7)
    before = first.take(stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = PromptStream(size=10, seed=7)
    resumed.take(4)  # a restarted process may have moved its fresh stream already
    resumed.load_state_dict(state)
    assert before + resumed.take(35 - stop_after) == uninterrupted


def test_split_off_holds_out_disjoint_rows_chosen_by_the_seed():
    rows = [{"prompt": str(i), "answer": str(i)} for i in range(50)]
    train, held = split_off(rows, 8, seed=0)
    assert len(train) == 42 and len(held) == 8
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})
    assert sorted([*train, *held], key=lambda r: int(r["prompt"])) == rows
    assert split_off(rows, 8, seed=0) == (train, held)
    assert split_off(rows, 8, seed=1)[1] != held
