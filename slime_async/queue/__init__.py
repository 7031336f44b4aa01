"""The streaming trajectory buffer: wire schema, buffer process, producer and consumer clients.

schema.py     a trajectory on the wire (MessagePack map, raw token arrays), validated on decode
messages.py   every message header, typed and shared by clients and server
client.py     ProducerClient (asyncio, generators), ConsumerClient (sync, learner), ping
server.py     the buffer process: two ROUTER sockets, one loop
state.py      what the buffer holds: groups, batches, producers' ledgers, counters
groups.py     the stored things: groups, delivered batches, the ready queue, ledgers
admission.py  the staleness policy: admission budget, grants, what is too old
wal.py        the write-ahead log that makes an ack durable
security.py   CurveZMQ keys and the loopback-only rule
"""
