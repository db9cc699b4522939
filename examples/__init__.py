"""Runnable examples of agents trained through the farm's `agent` environment kind."""
