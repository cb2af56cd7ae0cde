"""What crosses a process boundary: typed commands and replies, the gloo control plane, activations between
stages, the rank layout, and the request-field rules both sides apply."""
