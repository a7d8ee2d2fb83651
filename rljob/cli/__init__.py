"""The `rljob` command line."""
