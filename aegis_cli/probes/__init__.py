"""Probes: each runs one family of checks on one device and returns evidence."""
