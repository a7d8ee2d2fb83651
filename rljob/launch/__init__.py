"""Launchers: start every role of a job as local processes."""
