"""The learner: batches of complete groups in, updated weights out.

It consumes groups (`source`), prepares batches (`batch`), computes returns,
advantages and losses as pure functions (`algorithms`), trains (`trainer`,
`distributed`), pushes and verifies weights (`weights`), checkpoints and resumes
exactly (`checkpoint`), feeds tasks inside the admission budget (`tasks`), and logs
one typed record per step (`record`). `python -m learner` runs it.
"""
