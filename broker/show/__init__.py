"""The broker's half of `python -m broker show`: where a group is found and the arguments.

`source` finds one trajectory group (live stream or archive); `cli` registers the
command's arguments and hands the command to `farm.show`, which draws the group with
the learner's maths (they sit above the broker).
"""
