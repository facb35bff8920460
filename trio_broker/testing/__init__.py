"""Public hypothesis strategies and model checks for trio_broker.

Needs the ``testing`` extra (``pip install trio_broker[testing]``), which brings
hypothesis. Nothing here imports trio.
"""
