"""Public hypothesis strategies and model checks for trio_broker, and the fleet simulator.

The model checks need the ``testing`` extra (``pip install trio_broker[testing]``),
which brings hypothesis; the simulator (:mod:`trio_broker.testing.sim`) needs
nothing beyond the library. Nothing here imports trio.
"""
