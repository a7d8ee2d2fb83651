"""The built images (`make images`) run under a real OCI runtime: entrypoints, and a job's pods as containers."""
