"""The trio layer: sockets, processes, the database and time around the core.

It owns no policy: every decision comes from :mod:`trio_broker.core`. Here live
the connection driver both sides share (:mod:`~trio_broker.trio.driver`: frames and
timer ticks into a core, its frames out), the execserver service
(:mod:`~trio_broker.trio.execserver`) and its inspection documents and metrics
(:mod:`~trio_broker.trio.inspection`), the client
(:mod:`~trio_broker.trio.client`), the one-time pipes (:mod:`~trio_broker.trio.pipes`),
the runner contract and the reference command runner (:mod:`~trio_broker.trio.runner`),
process groups and host probes, the PostgreSQL queue (:mod:`~trio_broker.trio.store`)
and its dispatcher (:mod:`~trio_broker.trio.dispatcher`).
"""
