"""Clone: a clustered key-value state replication service over ZeroMQ."""
