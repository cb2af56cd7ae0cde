"""Owner: the CPU wing: C kernels built at run time, packed Linears, fused norms (never on a GPU's path)."""
