"""Broker: client sessions, routing to actors, durable trajectory segments in Redis."""
