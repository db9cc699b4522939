"""How a role process of the farm starts: configuration, logging, metrics, signals.

Every role (`python -m broker`, `workers`, `learner`, `inference`, and the children
that `farm up` supervises) starts through `launch.runner.start`, and resolves its
configuration with `launch.settings.resolve`: flags, then ``FARM_*`` environment
variables, then a TOML file, into a role model that nests its components' own
config models. This package imports neither torch nor Redis, so `--help` is instant.
"""
