"""Data files shipped with the envs package (the built-in coding problems)."""
