"""fog_broker."""
