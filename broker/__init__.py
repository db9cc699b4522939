"""The wire contract of the farm and everything that moves entries through Redis.

It owns the message types (`messages`), the msgpack codec and its field names
(`codec`), every Redis key name (`keys`), connections and the translation of
redis-py errors into the broker's own (`connection`, `errors`), producing and
consuming through consumer groups with reclaim, dead letters and dedup
(`producer`, `consumer`, `deadletters`), the admission budget (`admission`), the
published policy version (`policy`), archive and replay, status, and riding out a
Redis outage (`outage`). `python -m broker` is its operator command.
"""
