"""Runnable end-to-end examples of keras_linattn (run them with ``python -m examples.<name>``)."""
