"""Vision-language-action policies for gym tasks: a vision-language model (tiny-qwen2-vl, or a Qwen2-VL style
checkpoint) that reads an environment's camera image and the job's instruction and emits actions as tokens over
discretized bins (OpenVLA's scheme), with a value head for PPO; and `PickColor`, a tiny image task it learns.

The meeting point of the two task families, above both: may import `gym/` and `llm/` and every runtime room below
them, `rljob.algorithms` and `rljob.api`. The gym loops take the policy builder from here as an argument (the role
programs pass it), so `gym/` itself never imports `llm/`.
"""
