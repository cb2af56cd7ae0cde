"""A rank's bytes of a model on device, host and disk: shard stores, buffer pools, segments, checkpoint
slicing and reads."""
