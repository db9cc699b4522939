"""Built-in scenario files of the stateful environment (JSON)."""
