"""The hf engine takes each drawn token's log-prob as it is drawn (issue 33, item 4): it never asks `generate` for
the logits of every step (one fp32 rows x vocabulary tensor per generated token), and holds one step's at a time.
That the values are the trainer's is test_engine.py::test_engine_logprobs_match_the_trainers_recomputation."""

from __future__ import annotations

import copy

import torch

from rljob.runtime.llm.engines import hf
from rljob.runtime.llm.engines.base import Sampling, sampling_logprobs
from rljob.runtime.llm.engines.hf import HFEngine
from tests.runtime.llm.engines.test_engine import CPU, policy, prompts  # noqa: F401 (fixtures)


def test_generate_keeps_no_per_step_logits_and_the_recorder_one_step_of_them(policy, prompts, monkeypatch):  # noqa: F811
    model, tokenizer = policy
    engine = HFEngine(copy.deepcopy(model), tokenizer, CPU)
    asked: list[bool] = []
    returned: list[object] = []
    generate = engine.model.generate

    def recording(*args, **kwargs):
        asked.append(bool(kwargs["generation_config"].output_logits))
        out = generate(*args, **kwargs)
        returned.append(out.logits)
        return out

    monkeypatch.setattr(engine.model, "generate", recording)
    held: list[int] = []
    call = hf._SampledLogprobs.__call__

    def counting(self, input_ids, scores):
        result = call(self, input_ids, scores)
        held.append(self._step.numel())  # the one [rows, vocabulary] tensor it keeps
        return result

    monkeypatch.setattr(hf._SampledLogprobs, "__call__", counting)
    sampling = Sampling(n=3, temperature=0.8, max_tokens=8)
    out = engine.generate(prompts, sampling)
    assert asked == [False] and returned == [None]
    rows, vocab = len(prompts) * 3, model.config.vocab_size
    assert held and all(size == rows * vocab for size in held)
    assert all(len(c.logprobs) == len(c.token_ids) for group in out for c in group)


def test_the_recorder_gives_each_drawn_token_its_log_prob_under_the_step_s_raw_logits():
    torch.manual_seed(0)
    steps = [torch.randn(4, 11) for _ in range(3)]
    drawn = torch.randint(0, 11, (4, 3))
    recorder = hf._SampledLogprobs(0.7)
    sequence = torch.zeros(4, 2, dtype=torch.long)  # the prompt
    for t, logits in enumerate(steps):
        recorder(sequence, logits.clone())
        sequence = torch.cat([sequence, drawn[:, t : t + 1]], dim=1)
    expected = sampling_logprobs(torch.stack(steps, dim=1), drawn, 0.7)
    assert torch.allclose(recorder.finish(sequence), expected)
