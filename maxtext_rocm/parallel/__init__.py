"""Mesh-aware algorithms that sharding rules alone cannot express, built from the config and the
mesh outside models/ and handed to the model as plain functions (see DESIGN.md)."""
