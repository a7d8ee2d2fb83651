"""Multi-turn episodes: env tokens masked out of the loss, logprobs aligned, the env served over the transport."""

from __future__ import annotations

import threading

import pytest
import torch

from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec, TextEnvSpec
from rljob.launch.local import free_ports
from rljob.runtime.llm.data.rows import arithmetic_rows
from rljob.runtime.llm.engines.base import Sampling
from rljob.runtime.llm.engines.hf import HFEngine
from rljob.runtime.llm.episodes.multiturn import (
    EpisodeRunner,
    TextEnvClient,
    episode_metrics,
    render_env_messages,
    special_token,
)
from rljob.runtime.llm.episodes.textenv import TextEnv
from rljob.runtime.llm.models.policy import build_char_tokenizer, load_policy
from rljob.runtime.llm.training.learner import collate, token_logprobs
from rljob.runtime.roles.textenv import TextEnvService
from rljob.runtime.wire.transport import RequestServer

# --- the sample: loss mask and logprobs over a hand-built two-turn response ----------------------------


def test_a_two_turn_sample_trains_only_on_model_tokens_with_aligned_logprobs():
    # prompt [1 2 3] | turn 1: 4 5 (model) | env reply: 6 7 | turn 2: 8 (model)
    sample = {
        "prompt_ids": [1, 2, 3],
        "response_ids": [4, 5, 6, 7, 8],
        "rollout_logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3],
        "loss_mask": [1, 1, 0, 0, 1],
        "advantage": 0.5,
    }
    batch = collate([sample], pad_id=0)
    # Position t predicts token t + 1: positions 2..6 predict the response tokens 4 5 6 7 8.
    assert batch.targets[0].tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert batch.response_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert batch.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert batch.advantages[0].tolist() == [0, 0, 0.5, 0.5, 0.5, 0.5, 0.5]  # masked where the mask is 0


def test_a_sample_without_a_loss_mask_trains_on_its_whole_response_as_before():
    single = {"prompt_ids": [1, 2], "response_ids": [3, 4], "rollout_logprobs": [-0.5, -0.25], "advantage": 1.0}
    masked = {**single, "loss_mask": [1, 1]}
    plain, ones = collate([single], pad_id=0), collate([masked], pad_id=0)
    for name in ("input_ids", "attention_mask", "response_mask", "targets", "advantages", "rollout_logprobs"):
        assert torch.equal(getattr(plain, name), getattr(ones, name)), name
    assert plain.response_mask[0].tolist() == [0, 1, 1]


# --- episodes through a real engine and a real env server ---------------------------------------------


class TwoTurns(TextEnv):
    """Opens with `go`, answers every turn with `ok`, and ends after the second turn: whatever the model says."""

    def reset(self, row):
        return [{"role": "user", "content": "go\n"}]

    def step(self, messages, response, row):
        turns = sum(m["role"] == "assistant" for m in messages) + 1
        return [{"role": "tool", "content": "ok\n"}], 0.25, turns >= 2, {"tool_calls": 1, "answer": row["answer"]}


class Broken(TextEnv):
    def step(self, messages, response):
        raise RuntimeError("tool crashed")


TASK = LLMTask(
    dataset=DatasetSpec(builtin="arithmetic", size=40),
    max_prompt_length=16,
    max_response_length=40,
    env=TextEnvSpec(module="tests.py:TwoTurns"),
)
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=2))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def policy():
    model, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=CPU)
    return model.eval(), tokenizer


class EnvServer:
    """A TextEnvService on the real transport, answering from a thread."""

    def __init__(self, env: TextEnv) -> None:
        self.endpoint = f"127.0.0.1:{free_ports(1)[0]}"
        self.service = TextEnvService(env, type(env).__name__)
        self.server = RequestServer(
            self.endpoint, {"status": self.service.status, "reset": self.service.reset, "step": self.service.step}
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop.is_set,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


@pytest.fixture
def serve():
    servers: list[EnvServer] = []

    def start(env: TextEnv) -> EnvServer:
        servers.append(EnvServer(env))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def runner(policy, endpoints, max_turns=3, max_response_tokens=40) -> EpisodeRunner:
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer, CPU)
    return EpisodeRunner(
        engine, tokenizer, TextEnvClient(endpoints, timeout=1.0), max_turns, max_response_tokens, False
    )


ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12+9=", "answer": "21"}]


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_episodes_alternate_turns_and_env_replies_with_env_tokens_masked_and_logprobs_aligned(policy, serve):
    model, tokenizer = policy
    server = serve(TwoTurns())
    episodes = runner(policy, [server.endpoint])
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in ROWS]
    torch.manual_seed(0)
    groups = episodes.run(prompts, ROWS, Sampling(n=3, max_tokens=6))
    episodes.close()
    assert [len(g) for g in groups] == [3, 3]
    go, ok = encode(tokenizer, "go\n"), encode(tokenizer, "ok\n")
    samples = []
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ids, mask, logprobs = c["token_ids"], c["loss_mask"], c["logprobs"]
            assert len(ids) == len(mask) == len(logprobs)
            assert c["turns"] == 2 and c["tool_calls"] == 2 and c["env_reward"] == 0.5 and c["env_errors"] == 0
            # opening (env) | turn 1 (model) | "ok" (env) | turn 2 (model); the reply to the last turn is dropped
            assert ids[: len(go)] == go and mask[: len(go)] == [0] * len(go)
            turn_one = mask.index(0, len(go)) - len(go)
            first_end = len(go) + turn_one
            assert ids[first_end : first_end + len(ok)] == ok
            assert mask == [0] * len(go) + [1] * turn_one + [0] * len(ok) + [1] * (len(ids) - first_end - len(ok))
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
            assert all(lp < 0.0 for lp, m in zip(logprobs, mask, strict=True) if m)
            second = ids[first_end + len(ok) :]
            assert c["response_text"] == tokenizer.decode(second, skip_special_tokens=True)
            samples.append({"prompt_ids": prompt, "response_ids": ids, "rollout_logprobs": logprobs, "loss_mask": mask})
    # The trainer, recomputing every position of the whole sequence, agrees with the rollout on each model token.
    batch = collate([{**s, "advantage": 0.0} for s in samples], tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, batch, temperature=1.0, with_entropy=False)
    trained = batch.response_mask.bool()
    assert int(trained.sum()) == sum(sum(s["loss_mask"]) for s in samples)
    torch.testing.assert_close(recomputed[trained], batch.rollout_logprobs[trained], atol=1e-4, rtol=0)
    assert server.service.steps == 12  # two turns of six episodes
    metrics = episode_metrics([c for g in groups for c in g])
    assert metrics == {
        "turns_mean": 2.0,
        "tool_call_rate": 1.0,
        "tool_calls_mean": 2.0,
        "env_reward_mean": 0.5,
        "env_errors": 0,
    }


def test_the_last_allowed_turn_is_still_scored_by_the_env_but_gets_no_reply(policy, serve):
    _, tokenizer = policy
    server = serve(TwoTurns())
    episodes = runner(policy, [server.endpoint], max_turns=1)
    (group,) = episodes.run([tokenizer("3+4=")["input_ids"]], ROWS[:1], Sampling(n=2, max_tokens=5))
    episodes.close()
    go = encode(tokenizer, "go\n")
    for c in group:
        assert c["turns"] == 1 and c["env_reward"] == 0.25
        assert c["loss_mask"] == [0] * len(go) + [1] * (len(c["token_ids"]) - len(go))


def test_an_episode_stops_at_max_response_length_counting_env_tokens(policy, serve):
    _, tokenizer = policy
    server = serve(TwoTurns())
    budget = len(encode(tokenizer, "go\n")) + 3
    episodes = runner(policy, [server.endpoint], max_response_tokens=budget)
    (group,) = episodes.run([tokenizer("3+4=")["input_ids"]], ROWS[:1], Sampling(n=4, max_tokens=6))
    episodes.close()
    for c in group:
        assert len(c["token_ids"]) <= budget
        if len(c["token_ids"]) == budget:
            assert c["finish_reason"] == "length"


def test_an_env_that_raises_ends_the_episode_and_is_counted(policy, serve):
    _, tokenizer = policy
    server = serve(Broken())
    episodes = runner(policy, [server.endpoint])
    (group,) = episodes.run([tokenizer("3+4=")["input_ids"]], ROWS[:1], Sampling(n=2, max_tokens=4))
    episodes.close()
    assert [(c["turns"], c["env_errors"], c["env_reward"]) for c in group] == [(1, 1, 0.0), (1, 1, 0.0)]
    assert server.service.errors == 2 and episodes.env.errors == 2


def test_a_silent_env_replica_is_skipped_for_another(policy, serve):
    _, tokenizer = policy
    server = serve(TwoTurns())
    silent = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens here
    episodes = runner(policy, [silent, server.endpoint])
    groups = episodes.run([tokenizer(r["prompt"])["input_ids"] for r in ROWS], ROWS, Sampling(n=1, max_tokens=4))
    episodes.close()
    assert [c["turns"] for g in groups for c in g] == [2, 2]


# --- the environment's messages in the chat template ---------------------------------------------------

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Qwen2/Qwen2.5/Qwen3's ChatML: a line break after each turn's <|im_end|>, the end-of-sequence token."""
LLAMA3 = (
    "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + "
    "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
"""Llama-3's: nothing after a turn's <|eot_id|>."""
GEMMA = (
    "{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + "
    "m['content'] + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
    "{% endif %}"
)
"""Gemma's: a turn ends with <end_of_turn> (an end id of the model's generation config), not the tokenizer's <eos>."""
QWEN3 = CHATML.replace(
    "'<|im_start|>' + m['role'] + '\n' + m['content']",
    "'<|im_start|>' + m['role'] + '\n' + ('<think>\n\n</think>\n\n' if m['role'] == 'assistant' and loop.last "
    "else '') + m['content']",
)
"""ChatML as Qwen3 renders it: the last assistant turn (only) opens with an empty <think> block."""


def chat_tokenizer(template: str, eos: str):
    """The builtin tokenizer over printable text with real chat templates' special tokens, `eos` its end of sequence."""
    import string

    from transformers import AddedToken

    tokenizer = build_char_tokenizer([string.printable])
    specials = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    specials += ["<start_of_turn>", "<end_of_turn>", "<eos>", "<|begin_of_text|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in specials]})
    tokenizer.eos_token, tokenizer.chat_template = eos, template
    return tokenizer


@pytest.mark.parametrize(
    ("template", "end", "eos"),
    [(CHATML, "<|im_end|>", "<|im_end|>"), (LLAMA3, "<|eot_id|>", "<|eot_id|>"), (GEMMA, "<end_of_turn>", "<eos>")],
    ids=["chatml", "llama3", "gemma"],
)
def test_a_reply_after_a_model_turn_reads_as_the_chat_template_renders_the_conversation(template, end, eos):
    """The model writes its turn and the special token that ends it (the tokenizer's end of sequence, or one of the
    generation config's: Gemma's <end_of_turn>); the reply then carries the rest of the template's closing
    (ChatML's line break), so the model reads the conversation as the template renders it, as in its training. A
    turn cut short gets the whole closing."""
    tokenizer = chat_tokenizer(template, eos)
    prompt = [{"role": "user", "content": "What is 12*7?"}]
    turn, reply = "calc(12*7)", [{"role": "user", "content": "84"}]
    whole = tokenizer.apply_chat_template(
        [*prompt, {"role": "assistant", "content": turn}, *reply], add_generation_prompt=True, tokenize=False
    )
    opening = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    ended = special_token(tokenizer, tokenizer.convert_tokens_to_ids(end))  # what the runner finds as the last id
    assert opening + turn + end + render_env_messages(reply, tokenizer, chat=True, turn_end=ended) == whole
    cut = special_token(tokenizer, tokenizer(turn, add_special_tokens=False)["input_ids"][-1])
    assert cut == ""
    assert opening + turn + render_env_messages(reply, tokenizer, chat=True, turn_end=cut) == whole


def test_a_template_that_renders_earlier_turns_otherwise_still_gets_the_turn_closing():
    """Qwen3: the conversation so far is not a prefix of it with the reply added (the <think> block moves), so the
    reply is rendered alone, after the line break that ends the model's turn."""
    tokenizer = chat_tokenizer(QWEN3, "<|im_end|>")
    reply = [{"role": "user", "content": "84"}]
    expected = "\n<|im_start|>user\n84<|im_end|>\n<|im_start|>assistant\n"
    assert render_env_messages(reply, tokenizer, chat=True, turn_end="<|im_end|>") == expected
    assert render_env_messages(reply, tokenizer, chat=True) == expected[1:]  # an opening: no turn before it
    # A template that also writes the conversation's BOS: not again in the middle of it.
    tokenizer.chat_template, tokenizer.bos_token = "{{ bos_token }}" + QWEN3, "<|begin_of_text|>"
    assert render_env_messages(reply, tokenizer, chat=True, turn_end="<|im_end|>") == expected
