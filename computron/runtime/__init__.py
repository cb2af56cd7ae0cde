"""Starting and stopping processes: spawn and attach modes, the fork server, per-process set-up, replies
before the engine exists."""
