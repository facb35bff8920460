"""The sans-IO core: every rule of the broker protocol, with no I/O and no clock.

Each object here is fed inputs (frames, timer ticks, job ends, each with ``now``)
and asked what to do (frames to send, effects to carry out, when to be woken):
the trio layer (:mod:`trio_broker.trio`) does the waiting and the I/O. Importing
any module of this folder leaves trio unloaded.

- :mod:`~trio_broker.core.protocol`: the wire messages and their codec.
- :mod:`~trio_broker.core.book`, :mod:`~trio_broker.core.pool`,
  :mod:`~trio_broker.core.broker`: the execserver side (want-book, slot pool, broker).
- :mod:`~trio_broker.core.client`: the client side (pools, first offer wins), with
  :mod:`~trio_broker.core.client_values` (its configuration and effects).
- :mod:`~trio_broker.core.sansio`, :mod:`~trio_broker.core.liveness`: what both sides share.
- :mod:`~trio_broker.core.admission`: how much work a dispatcher may have in flight.
- :mod:`~trio_broker.core.callers`: errors, not requeues, for work a caller waits for.
- :mod:`~trio_broker.core.endings`: what a job's end means to its caller: the receipt's
  rules (interrupted, whole output, the decisive line) and one exception per failure.
- :mod:`~trio_broker.core.supervision`: the verdicts of a running job's watchdog, and
  how a job ends (its receipt's status and error from what the runner observed).
- :mod:`~trio_broker.core.errors`: every exception the library raises, by blame, and
  the protocol's ``ERROR`` codes.
"""
