"""The optimizer step over the storage tiers: the tier and states interfaces, the device and host tiers, the
optimizer that walks a rank's shards, where the reduced gradient shard lives, the publication of the updated
parameters and the overlapped step's readiness."""
