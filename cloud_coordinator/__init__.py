"""cloud_coordinator."""
