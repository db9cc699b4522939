"""Built-in CodeGym environment sources: read with ast on the host, run only in the sandbox."""
