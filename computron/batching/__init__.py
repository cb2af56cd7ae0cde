"""Per model kind, what a request is and how requests become one batch and their answers (master side:
prepare at submit, pad in ``make_batch``, split)."""
