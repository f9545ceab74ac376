"""In-training sensors (docs/architecture.md "Planned: in-training sensors")."""
