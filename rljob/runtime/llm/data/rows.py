"""Prompt data for llm jobs: load rows, render prompts, and walk them in a resumable order.

Sources (`spec.task.llm.dataset`, exactly one):
- `path`: a JSONL, JSON (a list of objects, or `{"data": [...]}`) or Parquet file, or a directory of them
  (files whose name starts with the split, e.g. `train-0.parquet`, when there are any; otherwise all);
- `name`: a dataset on the Hugging Face hub through `datasets` (offline from its cache when
  `HF_DATASETS_OFFLINE=1`/`HF_HUB_OFFLINE=1`);
- `builtin: arithmetic`: `"a+b="` -> the sum, operands in 0..`maxOperand`, generated from the seed: nothing
  to read (each row also carries `expression`, `"a+b"`, for templates);
- `builtin: shapes`: images of coloured shapes with a question about them, for vision-language policies.

Rows may carry images (`dataset.imageKey`): `rljob.runtime.llm.data.images` reads and encodes them.

Every error names the field to change (`DatasetError`), before any process starts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rljob.api.spec import DatasetSpec, LLMTask

Row = dict[str, Any]
SUFFIXES = (".jsonl", ".json", ".parquet")
FIELD = "spec.task.llm.dataset"


class DatasetError(ValueError):
    """The dataset cannot be used as configured; the message names the field and the fix."""


# --- sources ------------------------------------------------------------------------------------


def arithmetic_rows(size: int, seed: int, max_operand: int = 9) -> list[Row]:
    """`size` sums of two operands in [0, max_operand]: `{"prompt": "3+5=", "answer": "8", "expression": "3+5"}`.

    Single digits keep the task learnable from scratch by a tiny model on a CPU in minutes: the answer
    is one or two characters, so a random policy already finds some right answers to reinforce. `expression`
    (the sum without `=`) is there for templates, e.g. a supervised warm-up's `calc({expression})`.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "expression": f"{a}+{b}"})
    return rows


SHAPE_COLOURS = {"r": (220, 40, 40), "g": (40, 170, 60), "b": (40, 80, 220)}
SHAPES_SIDE = 32


def shapes_rows(size: int, seed: int) -> list[Row]:
    """`size` images of coloured shapes on white (32 x 32), each with a question a blind model can only guess:
    `{"prompt": "colour?", "answer": "r" | "g" | "b", "images": [image]}` (one shape, its colour) or
    `{"prompt": "count?", "answer": "1" | "2" | "3", ...}` (that many shapes of one colour, in distinct quarters).

    One-character answers keep it learnable by a tiny vision-language model on a CPU in minutes: a random policy
    finds right answers to reinforce, and a third of them by chance.
    """
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    rows: list[Row] = []
    quarter = SHAPES_SIDE // 2
    for _ in range(size):
        image = Image.new("RGB", (SHAPES_SIDE, SHAPES_SIDE), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        colour = rng.choice(sorted(SHAPE_COLOURS))
        if rng.random() < 0.5:
            side = rng.randint(10, 16)
            x, y = rng.randint(0, SHAPES_SIDE - side), rng.randint(0, SHAPES_SIDE - side)
            boxes, question, answer = [(x, y, side)], "colour?", colour
        else:
            count = rng.randint(1, 3)
            cells = rng.sample([(0, 0), (1, 0), (0, 1), (1, 1)], count)
            boxes = []
            for cx, cy in cells:
                side = rng.randint(6, 10)
                boxes.append(
                    (cx * quarter + rng.randint(0, quarter - side), cy * quarter + rng.randint(0, quarter - side), side)
                )
            question, answer = "count?", str(count)
        for x, y, side in boxes:
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape([x, y, x + side - 1, y + side - 1], fill=SHAPE_COLOURS[colour])
        rows.append({"prompt": question, "answer": answer, "images": [image]})
    return rows


def _read_file(path: Path) -> list[Row]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            rows = []
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as exc:
                            raise DatasetError(f"{FIELD}.path: {path} line {number} is not JSON ({exc.msg})") from None
            return rows
        if suffix == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{FIELD}.path: {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
            if isinstance(data, dict) and isinstance(data.get("data"), list):
                data = data["data"]
            if not isinstance(data, list):
                raise DatasetError(f"{FIELD}.path: {path} must hold a list of objects (or {{'data': [...]}})")
            return data
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                return pq.read_table(path).to_pylist()
            except Exception as exc:  # pyarrow raises several types for damaged or foreign files
                raise DatasetError(f"{FIELD}.path: {path} is not a readable Parquet file ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{FIELD}.path: cannot read {path} ({exc})") from None
    raise DatasetError(f"{FIELD}.path: {path} is not a .jsonl, .json or .parquet file")


def _files(path: Path, split: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DatasetError(
            f"{FIELD}.path: {path} does not exist (a relative path is resolved against the working directory)"
        )
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
    in_split = [p for p in files if p.name.startswith(split)]
    chosen = in_split or files
    if not chosen:
        raise DatasetError(f"{FIELD}.path: directory {path} holds no .jsonl, .json or .parquet file")
    return chosen


def _hub_rows(dataset: DatasetSpec) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{FIELD}.name: hub datasets need the `datasets` package (pip install datasets)") from None
    try:
        loaded = datasets.load_dataset(dataset.name, split=dataset.split)
    except Exception as exc:  # offline cache misses, unknown ids and bad splits all surface differently
        raise DatasetError(
            f"{FIELD}.name: cannot load {dataset.name!r} split {dataset.split!r} ({type(exc).__name__}: {exc}); "
            "pre-fill the Hugging Face cache or use dataset.path"
        ) from None
    return [dict(r) for r in loaded]


def resolve_path(path: str, base_dir: Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or base_dir is None else base_dir / p


def load_rows(task: LLMTask, seed: int = 0, base_dir: Path | None = None, columns: bool = True) -> list[Row]:
    """Every row of the configured split, checked to carry the prompt and answer keys (`columns`; an offline
    stage's rows are checked by `rljob.runtime.llm.data.offline_rows` instead)."""
    dataset = task.dataset
    if dataset.builtin == "arithmetic":
        rows = arithmetic_rows(dataset.size, seed, dataset.max_operand)
    elif dataset.builtin == "shapes":
        rows = shapes_rows(dataset.size, seed)
    elif dataset.path is not None:
        rows = [r for f in _files(resolve_path(dataset.path, base_dir), dataset.split) for r in _read_file(f)]
    elif dataset.name is not None:
        rows = _hub_rows(dataset)
    else:
        raise DatasetError(f"{FIELD}: set exactly one of path, name or builtin")
    check_rows(rows, dataset, columns)
    return rows


def check_rows(rows: list[Row], dataset: DatasetSpec, columns: bool = True) -> None:
    if not rows:
        raise DatasetError(f"{FIELD}: the dataset has no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{FIELD}: row {i} is {type(row).__name__}, not an object")
        if not columns:
            continue
        for key, field in ((dataset.prompt_key, "promptKey"), (dataset.answer_key, "answerKey")):
            if key not in row:
                raise DatasetError(
                    f"{FIELD}.{field}: row {i} has no column {key!r} (columns: {', '.join(sorted(row))}); "
                    f"set {FIELD}.{field} to one of them"
                )


def split_off(rows: list[Row], size: int, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, held-out): `size` rows chosen by the seed leave the training set."""
    order = list(range(len(rows)))
    random.Random(seed + 1).shuffle(order)
    held = set(order[:size])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


# --- rendering ----------------------------------------------------------------------------------


def is_options(value: Any) -> bool:
    """A list of texts or numbers (a multiple-choice row's `choices`): a template shows it as lettered options."""
    return (
        isinstance(value, list | tuple)
        and 0 < len(value) <= 26
        and all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value)
    )


def lettered(options: list[Any] | tuple[Any, ...]) -> str:
    """`["3", "4"]` -> "A. 3\nB. 4": how `{choices}` reads in a prompt template (the `multiple_choice` reward
    reads the letter back)."""
    return "\n".join(f"{chr(ord('A') + i)}. {option}" for i, option in enumerate(options))


def render_prompt(task: LLMTask, row: Row, tokenizer: Any) -> str:
    """The text the model continues: the template filled from the row, in the chat template when asked."""
    fields = {k: lettered(v) if is_options(v) else v for k, v in row.items() if isinstance(k, str)}
    fields["prompt"] = row[task.dataset.prompt_key]
    text = task.prompt_template.format_map(fields)
    if not task.apply_chat_template:
        return text if task.system_prompt is None else f"{task.system_prompt}\n{text}"
    messages = [] if task.system_prompt is None else [{"role": "system", "content": task.system_prompt}]
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(task: LLMTask, row: Row, tokenizer: Any) -> list[int]:
    """The prompt's token ids: `render_prompt`'s text with the special tokens the tokenizer adds, but for a
    beginning-of-sequence token the text already starts with. Llama-3's, Gemma's and Mistral's chat templates write
    it themselves and their tokenizers add another: the model would read two, which it never saw in training."""
    text = render_prompt(task, row, tokenizer)
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


# --- order --------------------------------------------------------------------------------------


class PromptStream:
    """A reshuffled pass over the rows per epoch; (epoch, position) is all its state, so resume is exact."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def take(self, count: int) -> list[int]:
        """The next `count` row indices; crosses into the next epoch when this one runs out."""
        return [next(self) for _ in range(count)]

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.position >= self.size:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
