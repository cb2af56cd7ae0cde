"""Owner: optional compute kernels below the models (``cpu``: the CPU wing); models imports them, never the reverse."""
