"""`python -m broker show`: one trajectory group rendered for a person.

`source` finds the group (live stream or archive), `view` turns it into decoded,
marked spans with the learner's advantages, `terminal` draws it with rich and `html`
writes a self-contained page; `cli` wires them to the command line.
"""
