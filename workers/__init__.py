"""The rollout workers: take tasks, run episode groups concurrently, publish, ack.

A worker (`worker`) reads tasks within its concurrency, runs each task's episodes
(`group`, `episode`) against the environments and the inference servers, with exact
token bookkeeping (`tokens`), and commits each complete group atomically with the
ack of its task. `python -m workers` runs one.
"""
