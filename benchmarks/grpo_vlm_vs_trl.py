"""rljob (`rljob run`, hf engine) vs TRL's `GRPOTrainer` on the tiny vision-language example, side by side.

The VLM counterpart of `grpo_vs_trl.py` (which it reuses: settings mapping, reward functions, the rljob side, the
TRL trainer loop and its timing, the summary), on examples/grpo-vlm-tiny-shapes.yaml: a tiny Qwen2-VL answers
questions about images of coloured shapes. Both sides train the same thing, one after the other on this machine:
- the same starting policy: rljob's builtin tiny-qwen2-vl (vision tower, language model, char tokenizer with
  Qwen2-VL's vision tokens, the PIL Qwen2-VL image processor), built from the manifest's seed. rljob builds it
  itself; TRL loads the same weights, tokenizer and image processor from a Hugging Face directory exported once
  here (checked to round-trip);
- the same prompts per step, images included: rljob's training rows in the order of its prompt stream, given to
  TRL as an unshuffled dataset with an `images` column and a conversational `prompt` (TRL's VLM format). TRL
  renders them through a Qwen2-VL processor whose chat template writes the text rljob renders; the script
  checks that TRL's processor gives every scheduled prompt the token ids and pixel values rljob's encoder gives;
- the same group size, response length, sampling, clip ratios, entropy bonus, optimizer, learning rate, fp32,
  the same reward (rljob's builtins; TRL's conversational completions unwrapped to their text) and the same
  never-sampled vision tokens.

The one workaround: transformers' `Qwen2VLProcessor` insists on a video processor, whose class needs torchvision,
which the Makefile removes (the registry's build is for another torch and breaks CPU torch imports). TRL gets
`ImageQwen2VLProcessor`, the same processor class without its video half (images only: nothing here has video).
Its outputs are checked against rljob's own encoding before TRL starts.

Figures per side and seed: completions/s over the training loop, wall time from process start to exit, where the
time goes, training accuracy vs samples, and the greedy held-out accuracy of the starting policy and of each side's
final policy, computed for both by `greedy_accuracy` below (rljob's prompt encoding, one `generate`).

Usage: python benchmarks/grpo_vlm_vs_trl.py [--sides rljob_hf,trl] [--steps 50] [--seeds 0,1] [--cores 2]
       [--set spec.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's rljob and benchmarks, also in the `--worker` process
    sys.path.insert(0, str(ROOT))

from benchmarks.grpo_vs_trl import (  # noqa: E402  (after the path fix above)
    SMOOTHING,
    _require,
    job_data,
    launch_trl,
    load_spec,
    machine,
    plot,
    rljob_actor_threads,
    run_rljob,
    side_settings,
    spread,
    summarize,
    train_trl,
    trl_reward_functions,
    trl_settings,
)

MANIFEST = ROOT / "examples" / "grpo-vlm-tiny-shapes.yaml"
DEFAULT_SIDES = ("rljob_hf", "trl")
DEFAULT_STEPS = 50
RESULT = "grpo_vlm_vs_trl"


# --- TRL's processor ------------------------------------------------------------------------------


def image_qwen2_vl_processor_class() -> type:
    """`ImageQwen2VLProcessor`: transformers' Qwen2VLProcessor without its video processor (whose class needs
    torchvision, absent here). A processor's parts are the parameters of its `__init__`, so leaving `video_processor`
    out of the signature is all it takes; images are processed exactly as Qwen2VLProcessor does."""
    from transformers import Qwen2VLProcessor

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kw)

    return ImageQwen2VLProcessor


def processor_chat_template() -> str:
    """The processor's chat template: each user text as it is (rljob has rendered it whole: template, system prompt,
    chat markup), its `<image>` placeholders written as Qwen2-VL's image markup, which the processor expands to one
    image token per merged patch. The conversation's image parts carry the images only."""
    from rljob.runtime.llm.data.images import IMAGE_PLACEHOLDER

    markup = "<|vision_start|><|image_pad|><|vision_end|>"
    return (
        "{% for m in messages %}{% for part in m['content'] %}{% if part['type'] == 'text' %}"
        f"{{{{ part['text'] | replace('{IMAGE_PLACEHOLDER}', '{markup}') }}}}"
        "{% endif %}{% endfor %}{% endfor %}"
    )


def trl_processor(model_dir: Path) -> Any:
    """TRL's processing class for the exported policy: its tokenizer and image processor in one processor."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    return image_qwen2_vl_processor_class()(image_processor, tokenizer, chat_template=processor_chat_template())


# --- prompts --------------------------------------------------------------------------------------


def prompt_encoder(spec: Any, model_dir: Path) -> Any:
    """rljob's encoder of the policy's prompts (`PromptEncoder`), from the exported directory."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from rljob.runtime.llm.data.prompts import PromptEncoder

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    tokenizer.image_processor = AutoImageProcessor.from_pretrained(model_dir)
    return PromptEncoder(spec.task.llm, tokenizer)


def prompt_text(task: Any, row: dict[str, Any], tokenizer: Any) -> str:
    """The text rljob's `PromptEncoder` renders for `row`, its images still as `<image>` placeholders."""
    from rljob.runtime.llm.data.images import IMAGE_PLACEHOLDER, image_values
    from rljob.runtime.llm.data.rows import render_prompt

    images = len(image_values(row, task.dataset))
    key = task.dataset.prompt_key
    if images and IMAGE_PLACEHOLDER not in task.prompt_template + str(row[key]):
        row = {**row, key: IMAGE_PLACEHOLDER * images + str(row[key])}
    return render_prompt(task, row, tokenizer)


def prompt_schedule(spec: Any, train_rows: list[dict], encoder: Any) -> list[dict[str, Any]]:
    """Every prompt rljob's actor takes, in order (`trainer.steps` x `trainer.batchSize`): the training row's index,
    its text columns and its prompt as a one-message conversation (TRL's VLM format); the images are added from
    the row by the TRL process (`trl_dataset`)."""
    from rljob.runtime.llm.data.images import ImageError
    from rljob.runtime.llm.data.rows import PromptStream

    task = spec.task.llm
    stream = PromptStream(len(train_rows), spec.trainer.seed)
    schedule: list[dict[str, Any]] = []
    while len(schedule) < spec.trainer.steps * spec.trainer.batch_size:
        index = next(stream)
        row = train_rows[index]
        try:
            ids, _ = encoder.encode(row, index)
        except ImageError:
            continue  # rljob skips a row whose image cannot be read
        if len(ids) > task.max_prompt_length:
            continue  # and one that is too long
        text = prompt_text(task, row, encoder.tokenizer)
        columns = {k: v for k, v in row.items() if isinstance(v, str | int | float) and k != task.dataset.prompt_key}
        schedule.append({**columns, "row": index, "prompt": [{"role": "user", "content": text}]})
    return schedule


def conversation(entry: dict[str, Any], images: list[Any]) -> list[dict[str, Any]]:
    """A schedule entry's prompt as TRL hands it to the processor (trl.data_utils.prepare_multimodal_messages: the
    row's images as image parts before the user's text)."""
    (message,) = entry["prompt"]
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": message["role"], "content": [*parts, {"type": "text", "text": message["content"]}]}]


def check_trl_prompts(spec: Any, schedule: list[dict], train_rows: list[dict], encoder: Any, processor: Any) -> int:
    """TRL's processor must give each scheduled prompt rljob's token ids and pixel values: checked on every distinct
    row of the schedule; returns how many. A difference is a SystemExit naming what differs."""
    import numpy as np

    from rljob.runtime.llm.data.images import row_images

    task = spec.task.llm
    rows = sorted({entry["row"]: entry for entry in schedule}.items())
    for index, entry in rows:
        row = train_rows[index]
        ids, vision = encoder.encode(row, index)
        images = row_images(row, index, task.dataset, None)
        out = processor.apply_chat_template(
            conversation=[conversation(entry, images)], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        if list(out["input_ids"][0]) != ids:
            raise SystemExit(
                f"spec.task.llm: TRL's processor tokenizes training row {index} as {list(out['input_ids'][0])}, "
                f"rljob as {ids}; the TRL side of this benchmark cannot reproduce this prompt format"
            )
        if vision is None:
            if "pixel_values" in out:
                raise SystemExit(f"spec.task.llm: training row {index}: TRL's processor sees images rljob does not")
            continue
        if not (
            np.array_equal(np.asarray(out["pixel_values"]), vision.pixel_values)
            and np.array_equal(np.asarray(out["image_grid_thw"]), vision.image_grid_thw)
        ):
            raise SystemExit(f"spec.task.llm: training row {index}: TRL's processor gives other pixel values")
    return len(rows)


# --- the starting policy and the evaluation -------------------------------------------------------


def export_initial_policy(spec: Any, directory: Path) -> None:
    """The policy every rljob process builds from the seed, as a Hugging Face directory (weights, tokenizer, image
    processor); checked to load back with identical weights."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rljob.runtime.llm.data.rows import load_rows
    from rljob.runtime.llm.models.policy import export_hf, load_policy

    rows = load_rows(spec.task.llm, seed=spec.trainer.seed)
    model, tokenizer = load_policy(spec.model, spec.task.llm, rows, spec.trainer.seed, torch.device("cpu"))
    export_hf(model, tokenizer, directory)
    built = model.state_dict()
    loaded = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).state_dict()
    if loaded.keys() != built.keys():
        raise RuntimeError(f"the exported policy's weights are named differently: {sorted(loaded.keys() ^ built)}")
    for key, value in loaded.items():
        if not torch.equal(value, built[key]):
            raise RuntimeError(f"the exported policy differs from rljob's builtin at {key}")


def greedy_accuracy(model_dir: Path, processing_dir: Path, spec: Any, rows: list[dict]) -> dict[str, Any]:
    """Greedy answers of the policy saved in `model_dir` to `rows` (their images included), scored with rljob's
    exact_match. The prompts are encoded by rljob's encoder with the tokenizer and image processor of
    `processing_dir` (the starting policy's: neither side trains them), the vision tokens never sampled."""
    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText

    from rljob.runtime.llm.data.images import VisionInputs
    from rljob.runtime.llm.episodes.rewards import exact_match
    from rljob.runtime.llm.models.policy import vision_kwargs, vision_token_ids

    task = spec.task.llm
    encoder = prompt_encoder(spec, processing_dir)
    tokenizer = encoder.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoded = [(row, *encoder.encode(row, i)) for i, row in enumerate(rows)]
    encoded = [(row, ids, vision) for row, ids, vision in encoded if len(ids) <= task.max_prompt_length]
    width = max(len(ids) for _, ids, _ in encoded)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids for _, ids, _ in encoded])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids, _ in encoded])
    vision = VisionInputs.concat([v for _, _, v in encoded])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **vision_kwargs(model, input_ids, vision),
            do_sample=False,
            max_new_tokens=spec.rollout.max_tokens or task.max_response_length,
            suppress_tokens=vision_token_ids(model.config) or None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    answers = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    key = task.dataset.answer_key
    right = [exact_match("", answer, row, answer_key=key) for (row, _, _), answer in zip(encoded, answers, strict=True)]
    return {"heldout_greedy_accuracy": float(np.mean(right)), "heldout_prompts": len(encoded)}


# --- the TRL side ---------------------------------------------------------------------------------


def conversational_rewards(spec: Any) -> tuple[list[Any], list[float]]:
    """rljob's reward as TRL functions (`grpo_vs_trl.trl_reward_functions`, same names and weights) for
    conversational prompts: TRL hands them messages, the builtins take the user's text and the reply's."""
    functions, weights = trl_reward_functions(spec)  # refuses what it cannot map
    return [_unwrapping(f) for f in functions], weights


def _unwrapping(reward: Any) -> Any:
    def conversational(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        return reward([_text(p) for p in prompts], [_text(c) for c in completions], **columns)

    conversational.__name__ = reward.__name__  # TRL logs rewards/<__name__>/mean
    return conversational


def _text(messages: Any) -> str:
    """The text of a message list's last message (a plain string stays as it is)."""
    if isinstance(messages, str):
        return messages
    content = messages[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")


def trl_dataset(spec: Any, schedule: list[dict[str, Any]]) -> Any:
    """The schedule as TRL's dataset: each entry with its training row's images (decoded and fitted as rljob does)
    in an `images` column."""
    from datasets import Dataset

    from rljob.runtime.llm.data.images import row_images

    train_rows, _ = job_data(spec)
    dataset = spec.task.llm.dataset
    return Dataset.from_list(
        [{**entry, "images": row_images(train_rows[entry["row"]], entry["row"], dataset, None)} for entry in schedule]
    )


def trl_worker(workdir: Path) -> None:
    """The TRL side's process: load the exported policy with its processor, train with GRPOTrainer, save."""
    import torch
    from transformers import AutoModelForImageTextToText

    from rljob.api import RLJob
    from rljob.runtime.llm.models.policy import vision_token_ids

    config = json.loads((workdir / "config.json").read_text())
    spec = RLJob.model_validate_json((workdir / "rljob.json").read_text()).spec
    schedule = [json.loads(line) for line in (workdir / "prompts.jsonl").read_text().splitlines()]
    model = AutoModelForImageTextToText.from_pretrained(config["initial_model"], dtype=torch.float32)
    train_trl(
        workdir,
        model,
        trl_processor(Path(config["initial_model"])),
        trl_dataset(spec, schedule),
        rewards=conversational_rewards(spec),
        # rljob never samples any of the vision markup tokens; TRL by default suppresses the image token only
        generation_kwargs={"suppress_tokens": vision_token_ids(model.config)},
    )


# --- the run --------------------------------------------------------------------------------------


DIFFERENCES = [
    "threads: rljob's actor computes on --cores threads while its rollout (1 thread) waits; TRL runs in one process "
    "on --cores threads",
    "rljob evaluates its policy greedily on the held-out images every spec.evaluation.interval steps and "
    "checkpoints every spec.checkpoint.interval steps inside its timed loop; TRL does neither",
    "images: rljob decodes and processes each row's images once and keeps the processed patches (VisionCache); "
    "TRL's dataset stores them as PNG, decoded each time a row is read, and its processor runs on them twice a "
    "step (generation, then the training forward)",
    "GRPO advantage: rljob divides by (std + 1e-6), TRL by (std + 1e-4) (both the sample std of the group)",
    "TRL's processor is transformers' Qwen2VLProcessor without its video half (ImageQwen2VLProcessor: its video "
    "processor class needs torchvision, which breaks CPU torch here); its token ids and pixel values for every "
    "scheduled prompt were checked equal to rljob's",
    "the starting policy: rljob builds it from the seed in each role process; TRL loads it from the exported "
    "directory (identical weights, tokenizer and image processor, checked)",
]


def run_seed(
    manifest: Path, sides: list[str], seed: int, steps: int, overrides: list[str], cores: list[int], workdir: Path
) -> tuple[dict[str, dict], dict[str, Any]]:
    """Every side on one seed, back to back: ({side: result}, this seed's settings)."""
    job_overrides = [f"spec.trainer.steps={steps}", f"spec.trainer.seed={seed}", *overrides]
    rljob = load_spec(manifest, job_overrides)
    spec = rljob.spec
    settings, differences = trl_settings(spec)
    conversational_rewards(spec)  # refuse a reward the TRL side cannot compute before anything runs
    _require(spec.model.source == "builtin", "spec.model.source", "must be builtin (tiny-qwen2-vl)")
    train_rows, eval_rows = job_data(spec)
    _require(bool(eval_rows), "spec.evaluation", "needs interval and size: the held-out prompts come from it")
    initial = workdir / "initial-policy"
    export_initial_policy(spec, initial)
    encoder = prompt_encoder(spec, initial)
    schedule = prompt_schedule(spec, train_rows, encoder)
    checked = check_trl_prompts(spec, schedule, train_rows, encoder, trl_processor(initial))
    before = greedy_accuracy(initial, initial, spec, eval_rows)["heldout_greedy_accuracy"]
    print(f"seed {seed}: initial held-out greedy accuracy {before:.3f} on {len(eval_rows)} prompts", flush=True)
    results = {}
    for side in sides:
        if side == "trl":
            result = launch_trl(Path(__file__), rljob, schedule, initial, workdir, len(cores), cores)
        else:
            threads = rljob_actor_threads(side, len(cores))
            result = run_rljob(manifest, side, job_overrides, workdir, cores, "cpu", threads)
        result.update(greedy_accuracy(Path(result.pop("model_dir")), initial, spec, eval_rows))
        # the machine's load when the side ended: on a shared machine, how much others ran beside it
        result.update(seed=seed, initial_heldout_greedy_accuracy=before, load_average_1m_at_end=os.getloadavg()[0])
        results[side] = result
        print(f"seed {seed} {side}: {_fmt(result)}", flush=True)
    return results, {
        "trl_grpo_config": settings,
        "differences": [*DIFFERENCES, *(d for d in differences if d.startswith(("KL estimator", "rljob adam")))],
        "prompts_per_step": spec.trainer.batch_size,
        "group_size": spec.algorithm.group_size,
        "max_response_tokens": spec.rollout.max_tokens or spec.task.llm.max_response_length,
        "train_prompts": len(train_rows),
        "heldout_prompts": len(eval_rows),
        "prompts_checked_equal_to_rljobs_encoding": checked,
        "reward": [f.model_dump(by_alias=True, exclude_none=True) for f in spec.reward.functions],
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES), help="comma-separated: rljob_hf[_async], trl")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="trainer.steps for every side")
    parser.add_argument("--seeds", default="0,1", help="comma-separated trainer seeds; every side runs each")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="manifest override, all sides")
    parser.add_argument(
        "--cores",
        type=int,
        default=min(2, len(os.sched_getaffinity(0))),
        help="every side runs pinned to the same first N cores of this process, computing on N threads (default 2)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "trl":
        trl_worker(args.workdir)
        return None
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    for side in sides:
        if side != "trl" and not (side.startswith("rljob_") and side_settings(side)[0]):
            raise SystemExit(f"--sides: {side!r} is neither trl nor rljob_<engine>[_async] (e.g. rljob_hf)")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    available = sorted(os.sched_getaffinity(0))
    if not 1 <= args.cores <= len(available):
        raise SystemExit(f"--cores: {args.cores} is not between 1 and the {len(available)} cores this process has")
    cores = available[: args.cores]
    info = {**machine(), "cores_used": cores}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{RESULT}.json"
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rljob-bench-grpo-vlm-") as tmp:
        for seed in seeds:
            results, settings = run_seed(
                args.manifest, sides, seed, args.steps, args.overrides, cores, Path(tmp) / f"seed-{seed}"
            )
            for side, result in results.items():
                runs[side].append(result)
            info["load_average_1m_at_end"] = os.getloadavg()[0]
            report = build_report(args, sides, seeds, runs, settings, info)
            path.write_text(json.dumps(report, indent=2) + "\n")  # after every seed: a cut-short run keeps its seeds
    plot(runs, args.out / f"{RESULT}.png", task="VLM shapes")
    print(json.dumps({side: {k: v for k, v in s.items() if k != "seeds"} for side, s in report["summary"].items()}))
    print(f"wrote {path} and {args.out / f'{RESULT}.png'}")
    return report


def build_report(
    args: argparse.Namespace,
    sides: list[str],
    seeds: list[int],
    runs: dict[str, list[dict]],
    settings: dict[str, Any],
    info: dict[str, Any],
) -> dict[str, Any]:
    """The JSON: per side, the mean and spread over the seeds run so far (`summary`), every run, the settings."""
    summary = summarize(runs)
    for side, results in runs.items():
        summary[side]["initial_heldout_greedy_accuracy"] = spread(
            [r["initial_heldout_greedy_accuracy"] for r in results]
        )
    return {
        "summary": summary,
        "runs": runs,
        "settings": {
            "manifest": str(args.manifest.relative_to(ROOT) if args.manifest.is_relative_to(ROOT) else args.manifest),
            "overrides": args.overrides,
            "steps": args.steps,
            "seeds": seeds,
            "seeds_done": [r["seed"] for r in runs[sides[0]]],
            "sides": sides,
            "cores": args.cores,
            "threads": "rljob actor: --cores (1 on an _async side), rollout 1; TRL: --cores",
            **settings,
            "timing": "completions_per_s and seconds_per_step: over the training loop (rljob: metrics.jsonl "
            "wall_time of the last step, from the actor's loop start; TRL: on_train_begin to the last on_step_end). "
            "wall_s: the side's process from start to exit. train_accuracy_last: mean exact match of the sampled "
            f"completions over the last {SMOOTHING} steps; heldout_greedy_accuracy: the final policy, greedy, the "
            "same code for both (initial_heldout_greedy_accuracy: the starting policy). Every side pinned to the "
            "same cores; each seed's sides back to back",
        },
        "notes": NOTES,
        "machine": info,
    }


NOTES = [
    "TRL 1.16's GRPOTrainer takes a vision-language model with a processor (ProcessorMixin), a conversational "
    "prompt and an images column. transformers' Qwen2VLProcessor requires a video processor, whose class needs "
    "torchvision; torchvision is absent here because the builds the registry offers break this CPU torch. TRL "
    "therefore gets ImageQwen2VLProcessor: Qwen2VLProcessor with video_processor left out of its __init__ "
    "(nothing else changed; images only). Its token ids, pixel values and patch grids were checked equal to "
    "rljob's encoding for every distinct training prompt of the run before TRL started.",
]


def _fmt(result: dict[str, Any]) -> str:
    return (
        f"{result['completions_per_s']:.0f} completions/s, {result['seconds_per_step']:.3f} s/step, "
        f"wall {result['wall_s']:.1f}s, train accuracy {result['train_accuracy_last']:.3f}, held-out greedy "
        f"{result['initial_heldout_greedy_accuracy']:.3f} -> {result['heldout_greedy_accuracy']:.3f}, "
        f"time {result['time_s']}"
    )


if __name__ == "__main__":
    main()
