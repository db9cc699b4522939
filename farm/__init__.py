"""The one-machine farm: the `farm` command and the stack it supervises.

`farm up` and `farm demo` start a private Redis, the CPU policy server, the learner
and the workers as supervised child processes (`supervisor`, `stack`), show the
farm's state (`view`, `console`) and serve the supervisor's own `/metrics`;
`farm status` prints a running farm's state from Redis.
"""
