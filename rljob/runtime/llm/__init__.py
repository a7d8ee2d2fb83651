"""LLM post-training runtime: reward scoring, and what the roles of an llm task share."""
