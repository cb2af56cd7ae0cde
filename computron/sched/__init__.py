"""Which model is resident, runs next, leaves or is preempted: pure policy, no torch, no processes, time
passed in."""
