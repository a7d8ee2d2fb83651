"""One module per role process: `env`, `rollout`, `actor`. `rljob role <name>` starts one of them."""
