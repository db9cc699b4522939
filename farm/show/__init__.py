"""`python -m broker show`: one trajectory group rendered for a person.

`broker.show.source` finds the group (live stream or archive), `view` turns it into
decoded, marked spans with the learner's advantages, `terminal` draws it with rich and
`html` writes a self-contained page; `cli` wires them to the command line. It lives
above the learner, whose maths it shows, and the workers, whose tokenizer decodes it;
`python -m broker show` hands its arguments here (`broker.show.cli.exec_show`).
"""
