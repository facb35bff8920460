"""A deterministic simulator of whole fleets, on the real cores.

See ``docs/SIMULATION.md``. The parts: :mod:`~trio_broker.testing.sim.scenario`
(what to simulate, as values or data), :mod:`~trio_broker.testing.sim.trace`
(a run's inputs, written and replayed), :mod:`~trio_broker.testing.sim.world`
(the engine), :mod:`~trio_broker.testing.sim.checks` (invariants and
liveness), :mod:`~trio_broker.testing.sim.run` (one seed, one trace),
:mod:`~trio_broker.testing.sim.shrink` (a failing trace made short),
:mod:`~trio_broker.testing.sim.report` (figures and the capacity report),
:mod:`~trio_broker.testing.sim.library` (the shipped scenarios). Nothing here
imports trio or opens a socket; time is virtual.
"""
