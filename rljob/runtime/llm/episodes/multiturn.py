"""Multi-turn episodes: the rollout alternates generation and text-environment steps, up to `maxTurns`.

For a chunk of prompts (token ids) and their dataset rows, `EpisodeRunner.run`:
1. asks the env role for each row's opening messages (`reset`) and appends their tokens to the prompt;
2. samples `n` first turns per prompt with the engine, then, for every episode still running, sends the turn
   (as text, with the messages so far and the row) to the env role (`step`); the environment's messages are
   tokenized and appended, and the next turn is generated from the whole context, one completion each;
3. stops an episode when the environment says `done`, after `maxTurns` model turns (the environment is still
   stepped on the last turn for its reward; its messages are dropped, no model turn would read them), or when
   the episode's response reaches `task.llm.maxResponseLength` tokens (model and environment tokens together,
   so the sequence fits the model; finish reason `length`). Each turn is capped at `rollout.maxTokens`.

A sample's response is everything after the prompt: opening, turns and environment messages, in order.
`loss_mask` marks the tokens the model generated (1) against the environment's (0); environment tokens get
logprob 0, so `token_ids`, `logprobs` and `loss_mask` stay aligned position by position and the trainer
learns only from the model's own tokens. A completion also carries `response_text` (the decoded LAST model
turn: the final answer the reward functions score), `turns` (model turns), `tool_calls` (the sum of the
environment's `info["tool_calls"]`), `env_reward` (the sum of its step rewards) and `env_errors`.

The sample's reward is `env_reward` plus the weighted reward functions (`spec.reward.functions`) of the final
answer: an environment that scores episodes itself needs no reward function beyond a zero-weight one, and one
that only serves tools (the calculator) leaves scoring to them.

Environment messages become text as the model reads them: without `task.llm.applyChatTemplate`, their
`content` strings concatenated; with it, what the tokenizer's chat template adds for those messages after an
assistant turn, generation prompt included, and first the rest of that turn's closing (`render_env_messages`).
The builtin tokenizer covers printable ASCII when a text env is configured (`rljob.runtime.llm.models.policy`);
characters it lacks are dropped from what the model reads.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rljob.runtime.llm.engines.base import GenerationEngine, Sampling
from rljob.runtime.llm.episodes.textenv import Message, Row
from rljob.runtime.process.retry import retry
from rljob.runtime.wire.transport import RequestClient, TransportError

ENV_TIMEOUT_S = 30.0
ENV_RETRY_S = 10.0
"""A replica that failed a request gets no new work for this long (it is being replaced, or is gone)."""
_PROBE_TURN = "rljob-probe-turn"
_CHAT_PROBE: list[Message] = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE_TURN}]


class TextEnvUnavailable(RuntimeError):
    """No env replica answered a request, after trying each of them."""


class TextEnvClient:
    """Calls the env replicas: a batch is split evenly over the live ones; a part whose replica fails goes to the
    next one, and the failed replica is left out for ENV_RETRY_S."""

    def __init__(self, endpoints: list[str], timeout: float = ENV_TIMEOUT_S) -> None:
        if not endpoints:
            raise ValueError("a text environment needs at least one env replica (spec.roles.env.replicas)")
        self.clients = [RequestClient(e, timeout=timeout, retries=1) for e in endpoints]
        self._down_until: dict[int, float] = {}
        self.errors = 0
        """Episodes the environment failed on (raised or returned something malformed), as its replicas count."""

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def _live(self) -> list[int]:
        """Replicas not seen failing in the last ENV_RETRY_S seconds (all of them when none is)."""
        now = time.monotonic()
        live = [i for i in range(len(self.clients)) if self._down_until.get(i, 0.0) <= now]
        return live or list(range(len(self.clients)))

    def _call(self, method: str, key: str, items: list[Any], reply_key: str) -> list[Any]:
        if not items:
            return []
        live = self._live()
        parts = [p for p in np.array_split(np.arange(len(items)), len(live)) if len(p)]
        started = [
            (live[k], part, self.clients[live[k]].send(method, {key: [items[j] for j in part]}))
            for k, part in enumerate(parts)
        ]
        out: list[Any] = [None] * len(items)
        for i, part, request in started:
            reply = self._receive(i, request, method, {key: [items[j] for j in part]})
            for j, value in zip(part, reply[reply_key], strict=True):
                out[int(j)] = value
        return out

    def _receive(self, first: int, request: int, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.clients[first].receive(request)
        except TransportError as exc:
            failure: Exception = exc
            self._down_until[first] = time.monotonic() + ENV_RETRY_S
        for offset in range(1, len(self.clients)):  # stateless: any other replica can answer the same request
            other = (first + offset) % len(self.clients)
            try:
                return self.clients[other].call(method, payload)
            except TransportError as exc:
                failure = exc
                self._down_until[other] = time.monotonic() + ENV_RETRY_S
        raise TextEnvUnavailable(f"no env replica answered {method}: {failure}")

    def wait_ready(self, deadline_s: float, stop: threading.Event | None = None, log: Any = None) -> None:
        """Return once some env replica answers `status` (they start beside the caller); TextEnvUnavailable
        after `deadline_s`."""

        def probe() -> Any:
            failure: Exception | None = None
            for client in self.clients:
                try:
                    return client.call("status", {}, timeout=2.0, retries=0)
                except TransportError as exc:
                    failure = exc
            assert failure is not None
            raise failure

        def waiting(exc: Exception, _: float) -> None:
            if log is not None:
                log.info("waiting for an env replica to answer (%s)", exc)

        try:
            retry(probe, retry_on=(TransportError,), deadline_s=deadline_s, stop=stop, on_retry=waiting)
        except TransportError as exc:
            raise TextEnvUnavailable(f"no env replica answered in {deadline_s:.0f}s: {exc}") from None

    def reset(self, rows: list[Row]) -> list[list[Message]]:
        return self._call("reset", "rows", rows, "messages")

    def step(self, episodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results = self._call("step", "episodes", episodes, "results")
        self.errors += sum("error" in r["info"] for r in results)
        return results


def render_env_messages(messages: list[Message], tokenizer: Any, chat: bool, turn_end: str | None = None) -> str:
    """The text the model reads for the environment's messages (see the module docstring).

    With the chat template, after a model turn (`turn_end` not None) the text starts with the rest of what the
    template writes after an assistant message. `turn_end` is the special token the model ended its turn with (an
    end-of-sequence id of the tokenizer or of the model's generation config: Gemma's `<end_of_turn>`, Llama-3's
    `<|eot_id|>`), which the model wrote itself, so only what the template puts after it follows (ChatML's line
    break after `<|im_end|>`); a turn cut short (maxTokens, a stop string: `turn_end` "") gets the whole closing."""
    if not messages:
        return ""
    if not chat:
        return "".join(m["content"] for m in messages)
    before = tokenizer.apply_chat_template(_CHAT_PROBE, tokenize=False)
    after = tokenizer.apply_chat_template(_CHAT_PROBE + messages, add_generation_prompt=True, tokenize=False)
    closing = ""
    if turn_end is not None and _PROBE_TURN in before:
        closing = before[before.rindex(_PROBE_TURN) + len(_PROBE_TURN) :]
        if turn_end and closing.startswith(turn_end):
            closing = closing[len(turn_end) :]
    if not after.startswith(before):
        # A template that renders earlier turns otherwise (Qwen3 drops the last turn's empty <think> block once a
        # message follows it): the messages alone.
        alone = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        bos = getattr(tokenizer, "bos_token", None)
        if bos and alone.startswith(bos):  # the template's start of a conversation, not of this reply
            alone = alone[len(bos) :]
        return closing + alone
    return closing + after[len(before) :]


def special_token(tokenizer: Any, token_id: int) -> str:
    """The text of `token_id` when it is a special token (what ends a model's turn), else ""."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    return str(added.content) if added is not None and added.special else ""


@dataclass
class Episode:
    """One sample's conversation after its prompt, as tokens and as messages."""

    prompt: int
    """Index of its prompt in the chunk."""
    context: list[int]
    """Prompt and response so far: what the next turn is generated from."""
    budget: int
    """Response tokens left (task.llm.maxResponseLength minus the response so far)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    final_text: str = ""
    turns: int = 0
    stepped: int = 0
    """Turns the environment has answered."""
    tool_calls: int = 0
    env_reward: float = 0.0
    env_errors: int = 0
    finish_reason: str = "stop"
    done: bool = False

    def add(self, tokens: list[int], logprobs: list[float] | None) -> bool:
        """Append model tokens (with logprobs) or environment tokens (None); False when the budget cut them."""
        kept = tokens[: max(self.budget, 0)]
        self.token_ids += kept
        self.logprobs += logprobs[: len(kept)] if logprobs is not None else [0.0] * len(kept)
        self.loss_mask += [1 if logprobs is not None else 0] * len(kept)
        self.context += kept
        self.budget -= len(kept)
        return len(kept) == len(tokens)

    def to_wire(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "loss_mask": self.loss_mask,
            "response_text": self.final_text,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "env_reward": self.env_reward,
            "env_errors": self.env_errors,
        }


class EpisodeRunner:
    """Runs the episodes of a chunk: the rollout's generation step when the job has a text environment."""

    def __init__(
        self,
        engine: GenerationEngine | None,
        tokenizer: Any,
        env: TextEnvClient,
        max_turns: int,
        max_response_tokens: int,
        chat: bool,
    ) -> None:
        self.engine = engine
        """None for the warm-up's demonstrations (`demonstrate`), whose turns are given, not generated."""
        self.tokenizer, self.env = tokenizer, env
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens
        self.chat = chat

    def close(self) -> None:
        self.env.close()

    def encode(self, messages: list[Message], turn_end: str | None = None) -> list[int]:
        """Token ids of the environment's messages: an opening, or (`turn_end` not None) a reply to a model turn
        that ended with that special token, or was cut ("") (`render_env_messages`)."""
        text = render_env_messages(messages, self.tokenizer, self.chat, turn_end)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def run(self, prompts: list[list[int]], rows: list[Row], sampling: Sampling) -> list[list[dict[str, Any]]]:
        """`sampling.n` episodes per prompt, as completion dicts (see the module docstring), in prompt order."""
        openings = self.env.reset(rows)
        episodes: list[Episode] = []
        for p, (prompt, opening) in enumerate(zip(prompts, openings, strict=True)):
            opening_ids = self.encode(opening)
            for _ in range(sampling.n):
                episode = Episode(p, list(prompt), self.max_response_tokens, messages=list(opening))
                if not episode.add(opening_ids, None):
                    episode.done, episode.finish_reason = True, "length"
                episodes.append(episode)
        self._first_turn(episodes, len(prompts), sampling)
        while True:
            self._step_env(episodes, rows)
            running = [e for e in episodes if not e.done]
            if not running:
                break
            self._turn(running, sampling)
        return [[e.to_wire() for e in episodes if e.prompt == p] for p in range(len(prompts))]

    def demonstrate(
        self, prompts: list[list[int]], rows: list[Row], turns: list[list[list[int]]]
    ) -> list[tuple[dict[str, Any] | None, str]]:
        """One episode per prompt whose model turns are `turns[p]` (token ids, each ending as the engine ends a
        turn: with the end-of-sequence token) in place of generated ones, the environment opening and replying
        between them through the same steps as `run`: the sample a rollout gives when the model writes exactly
        these turns (logprobs 0). The environment is not stepped after the last turn (what it would append
        is never trained on). (completion, "") each, or (None, why) for a demonstration no rollout can give:
        the environment ended the episode before its last turn, or it is over maxResponseLength."""
        openings = self.env.reset(rows)
        episodes: list[Episode] = []
        for p, (prompt, opening) in enumerate(zip(prompts, openings, strict=True)):
            episode = Episode(p, list(prompt), self.max_response_tokens, messages=list(opening))
            if not episode.add(self.encode(opening), None):
                episode.done, episode.finish_reason = True, "length"
            episodes.append(episode)
        for k in range(max((len(t) for t in turns), default=0)):
            if k:
                self._step_env([e for e in episodes if len(turns[e.prompt]) > k], rows)
            for episode in episodes:
                if not episode.done and len(turns[episode.prompt]) > k:
                    tokens = turns[episode.prompt][k]
                    self._take(episode, tokens, [0.0] * len(tokens), "stop")
        results: list[tuple[dict[str, Any] | None, str]] = []
        for episode in episodes:
            wanted = len(turns[episode.prompt])
            if episode.finish_reason == "length":
                why = f"the episode is over task.llm.maxResponseLength ({self.max_response_tokens} tokens)"
                results.append((None, why))
            elif episode.env_errors:
                results.append((None, f"the environment failed on turn {episode.turns}"))
            elif episode.turns < wanted:
                results.append((None, f"the environment ended the episode after turn {episode.turns} of {wanted}"))
            else:
                results.append((episode.to_wire(), ""))
        return results

    def _first_turn(self, episodes: list[Episode], prompts: int, sampling: Sampling) -> None:
        """`n` first turns per prompt in one call: the episodes of a prompt share their context until here."""
        firsts = [next((e for e in episodes if e.prompt == p and not e.done), None) for p in range(prompts)]
        live = [e for e in firsts if e is not None]
        if not live:
            return
        cap = min(sampling.max_tokens, max(e.budget for e in live))
        assert self.engine is not None
        outputs = self.engine.generate([e.context for e in live], replace(sampling, max_tokens=cap))
        for first, completions in zip(live, outputs, strict=True):
            siblings = [e for e in episodes if e.prompt == first.prompt and not e.done]
            for episode, completion in zip(siblings, completions, strict=True):
                self._take(episode, completion.token_ids, completion.logprobs, completion.finish_reason)

    def _turn(self, running: list[Episode], sampling: Sampling) -> None:
        cap = min(sampling.max_tokens, max(e.budget for e in running))
        assert self.engine is not None
        outputs = self.engine.generate([e.context for e in running], replace(sampling, n=1, max_tokens=cap))
        for episode, (completion,) in zip(running, outputs, strict=True):
            self._take(episode, completion.token_ids, completion.logprobs, completion.finish_reason)

    def _take(self, episode: Episode, tokens: list[int], logprobs: list[float], reason: str) -> None:
        kept = tokens[: max(episode.budget, 0)]
        whole = episode.add(tokens, logprobs)
        episode.turns += 1
        episode.final_text = self.tokenizer.decode(kept, skip_special_tokens=True)
        episode.finish_reason = reason if whole else "length"
        if episode.budget <= 0:
            episode.done = True  # out of response tokens: this turn is the final answer, cut or not

    def _step_env(self, episodes: list[Episode], rows: list[Row]) -> None:
        """Step every episode whose turn the environment has not seen yet; append or end."""
        pending = [e for e in episodes if e.stepped < e.turns]
        if not pending:
            return
        results = self.env.step(
            [{"messages": e.messages, "response": e.final_text, "row": rows[e.prompt]} for e in pending]
        )
        for episode, result in zip(pending, results, strict=True):
            episode.stepped = episode.turns
            episode.messages = [*episode.messages, {"role": "assistant", "content": episode.final_text}]
            episode.env_reward += float(result["reward"])
            info = result["info"]
            calls = info.get("tool_calls", 0)
            episode.tool_calls += calls if isinstance(calls, int) and not isinstance(calls, bool) else 0
            episode.env_errors += int("error" in info)
            if episode.done or result["done"] or episode.turns >= self.max_turns:
                episode.done = True
                continue
            replies = [dict(m) for m in result["messages"]]
            episode.messages = [*episode.messages, *replies]
            turn_end = special_token(self.tokenizer, episode.token_ids[-1]) if episode.token_ids else ""
            if not episode.add(self.encode(replies, turn_end), None) or episode.budget <= 0:
                episode.done, episode.finish_reason = True, "length"  # no room left for another turn


def episode_runner(context: Any, engine: GenerationEngine | None, tokenizer: Any) -> EpisodeRunner | None:
    """The rollout replica's runner for the job's text environment (on the env replicas), None without one;
    the actor's warm-up builds one without an engine for its demonstrations."""
    task = context.job.spec.task.llm
    if task is None or task.env is None:
        return None
    return EpisodeRunner(
        engine,
        tokenizer,
        TextEnvClient(context.identity.endpoints["env"]),
        max_turns=task.env.max_turns,
        max_response_tokens=task.max_response_length,
        chat=task.apply_chat_template,
    )


def episode_metrics(completions: list[dict[str, Any]]) -> dict[str, float | int]:
    """Per-step statistics of multi-turn episodes (keys documented in docs/metrics.md)."""
    count = max(len(completions), 1)
    return {
        "turns_mean": sum(c["turns"] for c in completions) / count,
        "tool_call_rate": sum(c["tool_calls"] > 0 for c in completions) / count,
        "tool_calls_mean": sum(c["tool_calls"] for c in completions) / count,
        "env_reward_mean": sum(c["env_reward"] for c in completions) / count,
        "env_errors": sum(c["env_errors"] for c in completions),
    }
